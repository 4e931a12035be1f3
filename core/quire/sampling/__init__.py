"""The sampler's parts; :mod:`quire.sampler` puts them together.

| module | role |
| --- | --- |
| ``batch.py`` | per-row parameter tensors of one batch composition (built once, cached) |
| ``penalties.py`` | per-row token counts, kept current each step; the three penalties |
| ``filters.py`` | min-p, top-k and top-p as masks on a batch of logits |
| ``noise.py`` | the random generators: one for the engine, one per seeded sequence |
| ``logprobs.py`` | logprob of a chosen token, its rank and the top alternatives |
"""
