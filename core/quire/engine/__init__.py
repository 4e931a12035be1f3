"""The engine: what turns requests into outputs, step by step.

- ``llm_engine.py``: ``LLMEngine``, the engine the offline ``LLM`` and the server drive;
  ``EngineStats``, the one snapshot of its state anyone else reads.
- ``scheduler.py``, ``block_manager.py``, ``sequence.py``: token-level continuous
  batching over a paged KV pool with prefix caching.
- ``output_processor.py``, ``detokenizer.py``, ``stop_strings.py``: from sampled tokens to
  text, logprobs and stopping rules.
"""

from quire.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine"]
