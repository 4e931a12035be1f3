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

Each other dtype the platform declares (bfloat16, float16) gets a row of its own,
against the cpu platform in float32: teacher-forced over the same prompts, the
platform's most likely next token must be the reference's at ``HALF_TOP1`` of the
positions, and the logprob of every prompt token within ``HALF_LOGPROB_TOL`` of the
reference's (a half dtype keeps 8 or 11 bits: greedy runs may part at a near-tie,
which is why this row is not token for token).
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
#: Half dtypes against float32, teacher-forced: the share of positions whose top token
#: must agree, and how far each prompt token's logprob may be (the cpu platform's own
#: gaps: bfloat16 0.064 with 99% agreement, float16 0.007 with 100%).
HALF_TOP1 = 0.9
HALF_LOGPROB_TOL = {torch.bfloat16: 0.15, torch.float16: 0.03}


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
        halves = [half for half in ctx.dtypes
                  if dtype == torch.float32 and half in HALF_LOGPROB_TOL]
        half_rows = []
        if halves:
            reference = teacher_forced(CpuPlatform(), path, torch.float32, block_size,
                                       prompts)
            half_rows = [_half_row(teacher_forced(ctx.platform, path, half, block_size,
                                                  prompts), reference, half, block_size)
                         for half in halves]
    figure = f"{len(prompts)} prompts x {MAX_TOKENS} tokens, twice (2nd via the prefix cache)"
    for run, (want_run, got_run) in enumerate(zip(expected, got), start=1):
        for i, (want, have) in enumerate(zip(want_run, got_run)):
            if want != have:
                at = next(j for j, (a, b) in enumerate(zip(want, have)) if a != b)
                reason = (f"pass {run}, prompt {i} (length {len(prompts[i])}) differs at "
                          f"token {at}: cpu gave {want[at]}, the platform {have[at]}")
                return [CheckResult(END_TO_END, Outcome.FAIL, case, reason, figure),
                        *half_rows]
    return [CheckResult(END_TO_END, Outcome.PASS, case, figure=figure), *half_rows]


def _half_row(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]],
              dtype: torch.dtype, block_size: int) -> CheckResult:
    """One half dtype's row: top-1 agreement and logprob gaps against float32."""
    name = str(dtype).removeprefix("torch.")
    case = f"{name} vs float32, block {block_size}"
    pairs = [(g, w) for got_p, want_p in zip(got, want) for g, w in zip(got_p, want_p)]
    agree = sum(g[0] == w[0] for g, w in pairs) / len(pairs)
    worst = max(abs(g[1] - w[1]) for g, w in pairs)
    tol = HALF_LOGPROB_TOL[dtype]
    figure = (f"{len(pairs)} positions teacher-forced: top-1 agreement {agree:.0%} "
              f"(>= {HALF_TOP1:.0%}), logprob max |err| {worst:.1e} (tol {tol})")
    if agree < HALF_TOP1 or worst > tol:
        why = (f"top-1 agreement {agree:.0%} < {HALF_TOP1:.0%}" if agree < HALF_TOP1
               else f"a prompt token's logprob is {worst:.3f} from float32's (tol {tol})")
        return CheckResult(END_TO_END, Outcome.FAIL, case, why, figure)
    return CheckResult(END_TO_END, Outcome.PASS, case, figure=figure)


def _prompts(block_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 99)

    def ids(n: int) -> list[int]:
        return torch.randint(FIRST_ORDINARY_ID, 300, (n,), generator=gen).tolist()

    shared = ids(block_size + 2)
    return [ids(5), shared + ids(3), ids(2 * block_size + 3), shared + ids(block_size)]


def generate(platform: Platform, path: Path, dtype: torch.dtype, block_size: int,
             prompts: list[list[int]]) -> list[list[list[int]]]:
    """Token ids of two greedy passes over ``prompts`` on an engine for ``platform``."""
    from quire.sampling_params import SamplingParams

    llm = _llm(platform, path, dtype, block_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [[out.outputs[0].token_ids for out in llm.generate(prompts, params)]
            for _ in range(2)]


def _llm(platform: Platform, path: Path, dtype: torch.dtype, block_size: int):
    from quire.config import EngineConfig
    from quire.engine import LLMEngine
    from quire.entrypoints.llm import LLM

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
    return LLM.from_engine(LLMEngine(config, single_platform_registry(platform)))


def teacher_forced(platform: Platform, path: Path, dtype: torch.dtype, block_size: int,
                   prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per prompt and position after the first: (the most likely token, the logprob of
    the prompt's own token), on an engine for ``platform`` at ``dtype``."""
    from quire.sampling_params import SamplingParams

    llm = _llm(platform, path, dtype, block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    result = []
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        result.append([
            (next(t for t, lp in entry.items() if lp.rank == 1), entry[token].logprob)
            for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])])
    return result


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
