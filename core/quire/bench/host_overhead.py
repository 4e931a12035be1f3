"""The host's share of a decode step: everything but the model's forward.

For each batch size, requests are brought to decoding, then decode steps are timed twice:
whole (``LLMEngine.step``), and with the executor's forward replaced by logits made once
(the same shapes, no model), so what is left is the host's work: scheduling, the step's
inputs (``StepItem``s), sampling, the core's bookkeeping and the front's output
processing (detokenization). The host-only step is split by where its time goes.

On an accelerator the host's share is what asynchronous scheduling and graph capture
attack; on the cpu platform it shows what the Python around the C kernels costs.
"""

from __future__ import annotations

import cProfile
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quire.engine import LLMEngine
from quire.executor.model_runner import StepResult
from quire.sampling_params import SamplingParams

#: Parts of a host-only step, in the order they run: the scheduler's choice, the step's
#: inputs and attention metadata (``ModelRunner.prepare``, ``build_metadata``), the
#: sampler's device half (``sample_on_device``: the argmax, which an accelerator runs on
#: the device), its host half (``to_host``: the lists), and the front's output
#: processing; the rest of the core's bookkeeping is the difference between their sum
#: and the host step.
PARTS = ("schedule", "inputs", "sample_device", "sample_host", "front")


@dataclass(frozen=True)
class HostOverhead:
    """Medians over the timed steps at one batch size, in seconds.

    ``host_less_device_s`` is the host step without the sampler's device half (what is
    left on the host when an accelerator runs the argmax)."""

    batch: int
    step_s: float
    host_step_s: float
    parts_s: dict[str, float]
    host_less_device_s: float = 0.0

    def figures(self) -> dict[str, float]:
        figures = {"batch": float(self.batch), "step_ms": self.step_s * 1e3,
                   "host_step_ms": self.host_step_s * 1e3,
                   "host_less_device_ms": self.host_less_device_s * 1e3,
                   "host_share": self.host_step_s / self.step_s if self.step_s else 0.0}
        figures.update({f"{part}_ms": s * 1e3 for part, s in self.parts_s.items()})
        # both halves together, under the name earlier results used
        figures["sample_ms"] = (self.parts_s["sample_device"]
                                + self.parts_s["sample_host"]) * 1e3
        return figures


class _Timed:
    """Sums the time spent in wrapped calls, per part, for one step."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - started
        return timed


def measure(engine: LLMEngine, batch: int, steps: int = 20,
            prompt_len: int = 16, profile: cProfile.Profile | None = None) -> HostOverhead:
    """Host overhead at ``batch`` decoding sequences; ``engine`` must be idle and run its
    core in this process. Leaves it idle. ``profile``, when given, is enabled around the
    host-only steps alone (the whole steps would be the model's)."""
    core = engine.core
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0.0)
    gen = torch.Generator().manual_seed(batch)
    rids = [engine.add_request(
        torch.randint(10, engine.vocab_size, (prompt_len,), generator=gen).tolist(), params)
        for _ in range(batch)]
    decoding: set[str] = set()
    while len(decoding) < batch:  # prefill until every sequence decodes
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    whole = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        whole.append(time.perf_counter() - started)

    timed = _Timed()
    logits = torch.randn(batch, engine.vocab_size, generator=gen)
    executor, scheduler, sampler = core.executor, core.scheduler, core.sampler
    saved = (executor.submit, executor.wait, scheduler.schedule, sampler.sample_on_device,
             sampler.to_host, core.step)

    runner = getattr(getattr(executor, "worker", None), "runner", None)
    if runner is None:
        raise ValueError("host overhead needs the model in the engine's process "
                         "(world size 1, the uni executor)")

    def submit(items: list[Any], released: list[int] | None = None,
               sampled: torch.Tensor | None = None) -> StepResult:
        """The step's inputs and attention metadata, as a forward builds them; no model.

        The logits are handed out as they are, not copied: making them is the forward's
        work (a copy of 256 x 49152 floats costs ~10 ms on this host's CPU), and these
        greedy requests without bias or penalties make the sampler only read them."""
        inputs = runner.prepare(items, released or (), sampled)
        runner.backend.build_metadata(inputs.batch)
        return StepResult(logits[: len(inputs.sample_items)], inputs.sample_items)

    executor.submit = timed.wrap("inputs", submit)  # type: ignore[method-assign]
    executor.wait = lambda handle: handle  # type: ignore[method-assign]
    scheduler.schedule = timed.wrap("schedule", scheduler.schedule)  # type: ignore[method-assign]
    # sample() is its two halves in a row; async scheduling calls them apart
    sampler.sample_on_device = timed.wrap(  # type: ignore[method-assign]
        "sample_device", sampler.sample_on_device)
    sampler.to_host = timed.wrap("sample_host", sampler.to_host)  # type: ignore[method-assign]
    host, parts = [], []
    try:
        for _ in range(steps):
            timed.spent = dict.fromkeys(PARTS, 0.0)
            core_spent = [0.0]

            def core_step(step: Callable[[], Any] = saved[-1]) -> Any:
                started = time.perf_counter()
                try:
                    return step()
                finally:
                    core_spent[0] = time.perf_counter() - started

            core.step = core_step  # type: ignore[method-assign]
            if profile is not None:
                profile.enable()
            started = time.perf_counter()
            engine.step()
            total = time.perf_counter() - started
            if profile is not None:
                profile.disable()
            host.append(total)
            timed.spent["front"] = total - core_spent[0]
            parts.append(dict(timed.spent))
    finally:
        (executor.submit, executor.wait, scheduler.schedule, sampler.sample_on_device,
         sampler.to_host, core.step) = saved
        for rid in rids:
            engine.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
    return HostOverhead(batch, statistics.median(whole), statistics.median(host),
                        {p: statistics.median(x[p] for x in parts) for p in PARTS},
                        statistics.median(h - x["sample_device"] for h, x in zip(host, parts)))
