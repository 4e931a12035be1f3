"""The end-to-end check: greedy generation on the platform equals the cpu platform's.

A tiny checkpoint is built in a temporary directory (:mod:`~quire.conformance.tiny_model`)
and both platforms run it through the real engine with the same settings: the platform's
default block size, a step budget of ``block_size + 5`` tokens (so long prompts are
chunked and decode rows share steps with prefill chunks), prompts that cross blocks, two
of them sharing a prefix longer than a block. The prompts run twice; the second pass
finds the first one's pages in the prefix cache. Every output token must be equal.

The dtype is float32 when the platform declares it (rounding differences cannot flip a
greedy choice of the tiny model's peaked logits there); otherwise the platform's first
dtype, with the cpu reference in that same dtype.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tiny_model import FIRST_ORDINARY_ID, build_tiny_checkpoint
from quire.interfaces.platform import Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.registry import ENTRY_POINT_GROUP, PlatformRegistry
from quire.plugins.spec import PLUGIN_API_VERSION, PlatformSpec

END_TO_END = "end-to-end"
MAX_TOKENS = 8
#: Pages granted to each engine's KV cache: an absolute budget, so no profiling run.
KV_CACHE_BYTES = 16 << 20


def check_end_to_end(ctx: CheckContext) -> list[CheckResult]:
    from quire.platforms.cpu import CpuPlatform

    dtype = torch.float32 if torch.float32 in ctx.dtypes else ctx.dtypes[0]
    block_size = ctx.block_sizes[0]
    case = f"{str(dtype).removeprefix('torch.')}, block {block_size}"
    prompts = _prompts(block_size, ctx.seed)
    with tempfile.TemporaryDirectory(prefix="quire-conformance-") as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "tiny-llama", seed=ctx.seed)
        expected = generate(CpuPlatform(), path, dtype, block_size, prompts)
        got = generate(ctx.platform, path, dtype, block_size, prompts)
    figure = f"{len(prompts)} prompts x {MAX_TOKENS} tokens, twice (2nd via the prefix cache)"
    for run, (want_run, got_run) in enumerate(zip(expected, got), start=1):
        for i, (want, have) in enumerate(zip(want_run, got_run)):
            if want != have:
                at = next(j for j, (a, b) in enumerate(zip(want, have)) if a != b)
                reason = (f"pass {run}, prompt {i} (length {len(prompts[i])}) differs at "
                          f"token {at}: cpu gave {want[at]}, the platform {have[at]}")
                return [CheckResult(END_TO_END, Outcome.FAIL, case, reason, figure)]
    return [CheckResult(END_TO_END, Outcome.PASS, case, figure=figure)]


def _prompts(block_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 99)

    def ids(n: int) -> list[int]:
        return torch.randint(FIRST_ORDINARY_ID, 300, (n,), generator=gen).tolist()

    shared = ids(block_size + 2)
    return [ids(5), shared + ids(3), ids(2 * block_size + 3), shared + ids(block_size)]


def generate(platform: Platform, path: Path, dtype: torch.dtype, block_size: int,
             prompts: list[list[int]]) -> list[list[list[int]]]:
    """Token ids of two greedy passes over ``prompts`` on an engine for ``platform``."""
    from quire.config import EngineConfig
    from quire.engine import LLMEngine
    from quire.entrypoints.llm import LLM
    from quire.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(path),
        device=platform.name,
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=block_size + 5,
        max_model_len=4 * block_size + 16,
        kv_cache_memory=KV_CACHE_BYTES,
    )
    llm = LLM.from_engine(LLMEngine(config, single_platform_registry(platform)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [[out.outputs[0].token_ids for out in llm.generate(prompts, params)]
            for _ in range(2)]


def single_platform_registry(platform: Platform) -> PlatformRegistry:
    """A registry that knows only ``platform`` (the object itself, not a new one), so the
    engine runs exactly what is under test whatever else is installed."""
    return PlatformRegistry(entry_points=[_EntryPoint(platform.name, _OnePlatform(platform))])


class _OnePlatform:
    """A plugin object whose one platform is a given instance."""

    def __init__(self, platform: Platform) -> None:
        self._platform = platform

    @hookimpl
    def quire_platforms(self) -> list[PlatformSpec]:
        return [PlatformSpec(self._platform.name, PLUGIN_API_VERSION, self._get,
                             "the platform under conformance test")]

    def _get(self) -> Platform:
        return self._platform


@dataclass(frozen=True)
class _EntryPoint:
    """Just enough of ``importlib.metadata.EntryPoint`` for the registry."""

    name: str
    plugin: object
    group: str = ENTRY_POINT_GROUP
    dist: None = None

    def load(self) -> object:
        return self.plugin
