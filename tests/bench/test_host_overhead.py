"""``quire bench host``: the host-only steps run no forward, the parts are all measured,
the engine is left idle; bad flags name themselves. (No figure is asserted: timings are
for benchmarks, not tests.)"""

from __future__ import annotations

import cProfile
import pstats

from quire.bench.host_overhead import PARTS, measure
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.cli import main


def test_the_host_steps_run_no_forward_and_leave_the_engine_idle(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu"))
    runner = engine.core.executor.worker.runner
    calls = []
    execute = runner.execute

    def counting(items, released=()):
        calls.append(len(items))
        return execute(items, released)

    runner.execute = counting
    result = measure(engine, batch=4, steps=3)
    # prefill and the 3 whole steps ran the model; the 3 host-only steps did not
    assert calls[-3:] == [4, 4, 4] and len(calls) >= 4
    figures = result.figures()
    assert figures["batch"] == 4 and figures["step_ms"] > 0 and figures["host_step_ms"] > 0
    assert all(figures[f"{p}_ms"] >= 0 for p in PARTS)
    # the host step is reported with and without the sampler's device half
    assert 0 < figures["host_less_device_ms"] <= figures["host_step_ms"]
    assert abs(figures["sample_ms"]
               - figures["sample_device_ms"] - figures["sample_host_ms"]) < 1e-9
    assert not engine.has_unfinished_requests()
    assert engine.core.block_manager.num_used_blocks == 0
    assert engine.core.executor.submit.__self__ is engine.core.executor  # restored


def test_a_profile_sees_the_host_only_steps_alone(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu"))
    runner = engine.core.executor.worker.runner
    profile = cProfile.Profile()
    measure(engine, batch=2, steps=3, profile=profile)
    called = {(fn[2], calls) for fn, (_, calls, *_rest) in pstats.Stats(profile).stats.items()}
    names = {name for name, _ in called}
    assert "sample_on_device" in names and "schedule" in names
    assert runner.execute.__name__ not in names  # the whole steps' forwards are not in it
    assert ("sample_on_device", 3) in called


def test_bad_flags_are_refused_naming_them(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("llama"))
    assert main(["bench", "host", "--model", path, "--batch-sizes", "4,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main(["bench", "host", "--model", path, "--tensor-parallel-size", "2"]) == 2
    assert "this process" in capsys.readouterr().err
