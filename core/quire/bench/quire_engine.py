"""Quire's side of a measurement: building the engine, warming it up, KV page size.

Every mode asks the same of a request: greedy decoding, ``ignore_eos`` and a fixed
``max_tokens``, so each request makes exactly its output length and every engine does
the same work.
"""

from __future__ import annotations

import gc

from quire.bench.stats import SpecCounts, spec_figures
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.engine.messages import EngineStats
from quire.plugins.registry import PlatformRegistry
from quire.sampling_params import SamplingParams

# A short request run once before any timing: first calls allocate and compile lazily.
_WARMUP_PROMPT_LEN = 8
_WARMUP_OUTPUT_LEN = 4


def greedy_params(output_len: int) -> SamplingParams:
    """Exactly ``output_len`` tokens, greedily (EOS does not stop it)."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def build_engine(config: EngineConfig, registry: PlatformRegistry) -> LLMEngine:
    """An engine for ``config``, warmed up. Frees the previous engine's memory first
    (call with no other engine alive when peaks are to be compared).

    :raises ValueError, RuntimeError: as :class:`LLMEngine` does.
    """
    gc.collect()
    engine = LLMEngine(config, registry)
    warm_up(engine)
    return engine


def warm_up(engine: LLMEngine) -> None:
    """Run one short request to completion."""
    prompt = [t % engine.vocab_size for t in range(1, _WARMUP_PROMPT_LEN + 1)]
    engine.add_request(prompt, greedy_params(_WARMUP_OUTPUT_LEN))
    while engine.has_unfinished_requests():
        engine.step(final_only=True)


def kv_page_bytes(engine: LLMEngine) -> int:
    """Bytes one KV page takes over all layers (K and V), on rank 0."""
    return engine.core.executor.bytes_per_block()


def describe(engine: LLMEngine) -> str:
    """A one-line description of the engine for reports."""
    cfg = engine.config
    return (f"quire on {engine.info.platform_name}, {str(cfg.dtype).removeprefix('torch.')}, "
            f"block_size={cfg.block_size}, kv_pages={engine.core.block_manager.num_blocks}, "
            f"max_num_seqs={cfg.max_num_seqs}, "
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}")


def spec_decode_figures(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """:func:`~quire.bench.stats.spec_figures` from the engine's counters before and
    after a run."""
    return spec_figures(spec_counts(before), spec_counts(after))


def spec_counts(stats: EngineStats) -> SpecCounts:
    return SpecCounts(stats.spec_num_drafts, stats.spec_num_draft_tokens,
                      stats.spec_num_accepted_tokens, tuple(stats.spec_accepted_per_pos))
