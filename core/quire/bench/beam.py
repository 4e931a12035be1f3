"""``quire bench beam``: beam search with W beams against W independent samples of the
same prompt: the most KV pages held at once (the scheduler's peak, which counts a page
shared by reference once) and the wall time of the request.

Both run ``max_tokens`` tokens past EOS (``ignore_eos``), so they compute the same number
of output tokens per sequence; the samples are seeded (``temperature`` 1). Each mode gets
an engine of its own, so each peak is that mode's alone; an untimed run of the same
request warms it first (same pages, so the peak is unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from quire.bench.report import Figure

BEAM_FIGURES = (
    Figure("peak_kv_pages", "peak KV pages"),
    Figure("peak_kv_tokens", "peak KV tokens (pages x block)"),
    Figure("wall_s", "wall (s)"),
    Figure("output_tokens", "output tokens"),
)


def compare(open_llm: Callable[[], Any], prompt: str, width: int, max_tokens: int,
            seed: int) -> dict[str, dict[str, float]]:
    """Figures per mode (``beam search``, ``n samples``) for one prompt.

    :param open_llm: a new ``LLM`` (a context manager) per call."""
    from quire import BeamSearchParams, SamplingParams

    beam = BeamSearchParams(width, max_tokens, ignore_eos=True)
    sample = SamplingParams(n=width, temperature=1.0, seed=seed, max_tokens=max_tokens,
                            ignore_eos=True)

    def run_beams(llm: Any) -> int:
        [out] = llm.beam_search([prompt], beam)
        return sum(len(s.tokens) for s in out.sequences) - width * len(
            llm.get_tokenizer().encode(prompt))

    def run_samples(llm: Any) -> int:
        [out] = llm.generate([prompt], sample)
        return sum(len(c.token_ids) for c in out.outputs)

    figures = {}
    for name, run in ((f"beam search, {width} beams", run_beams),
                      (f"{width} samples (n={width})", run_samples)):
        with open_llm() as llm:
            run(llm)  # warm-up
            start = time.perf_counter()
            tokens = run(llm)
            wall = time.perf_counter() - start
            stats = llm.engine.stats()
            block = llm.engine.config.block_size
        figures[name] = {"peak_kv_pages": stats.peak_used_blocks,
                         "peak_kv_tokens": stats.peak_used_blocks * block,
                         "wall_s": wall, "output_tokens": tokens}
    return figures
