"""Tensor and pipeline parallelism across worker processes (the ``mp`` executor, gloo on
cpu): greedy output equals the single-process engine and transformers float32 token for
token; a split the model cannot take is refused at start; a worker that dies is reported
and nothing is left running. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.executor.abstract import WorkerDied
from tiny_models import ARCHS, hf_greedy, hf_model

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _greedy(path, **options) -> list[list[int]]:
    with LLM(str(path), device="cpu", max_model_len=128, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _check_against_oracles(path, **options) -> None:
    hf = hf_model(path)
    expected = [hf_greedy(hf, p, 10) for p in PROMPTS]
    assert _greedy(path) == expected  # the single-process engine
    assert _greedy(path, **options) == expected


def test_tp2_llama_equals_one_process_and_transformers(tiny_checkpoint):
    _check_against_oracles(tiny_checkpoint("llama"), tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_tp2_every_architecture(tiny_checkpoint, arch):
    _check_against_oracles(tiny_checkpoint(arch), tensor_parallel_size=2)


def test_pp2_llama_equals_one_process_and_transformers(tiny_checkpoint):
    """Two stages, one layer each: hidden states and residual cross by send/recv."""
    _check_against_oracles(tiny_checkpoint("llama"), pipeline_parallel_size=2)


def test_pp2_keeps_two_micro_batches_in_flight(tiny_checkpoint):
    """Stage 0 computes one micro-batch while stage 1 computes the other; the outputs
    are still those of one process."""
    path = tiny_checkpoint("llama")
    prompts = PROMPTS * 2
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), device="cpu", max_model_len=128,
                                                pipeline_parallel_size=2))
    try:
        core = engine.core
        submit, depths = core.executor.submit, []

        def counting(items, released=None):
            depths.append(len(core._in_flight) + 1)
            return submit(items, released)

        core.executor.submit = counting
        rids = [engine.add_request(p, GREEDY) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids
                         for o in engine.step() if o.finished})
    finally:
        engine.shutdown()
    assert max(depths) == 2 and depths.count(2) > len(depths) // 2, depths
    with LLM(str(path), device="cpu", max_model_len=128) as one:
        assert [done[r] for r in rids] == [o.outputs[0].token_ids
                                           for o in one.generate(prompts, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_pp2_every_architecture(tiny_checkpoint, arch):
    """Qwen2's tied LM head sits on the last stage, which has no embedding."""
    _check_against_oracles(tiny_checkpoint(arch), pipeline_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_x_pp2_equals_one_process_and_transformers(tiny_checkpoint, arch):
    """4 processes: each of 2 stages split over 2 ranks (per-stage process groups)."""
    _check_against_oracles(tiny_checkpoint(arch), tensor_parallel_size=2,
                           pipeline_parallel_size=2)


@pytest.mark.slow
def test_tp4_replicates_kv_heads(tiny_checkpoint):
    """4 ranks over 2 KV heads: each KV head lives on two ranks."""
    _check_against_oracles(tiny_checkpoint("qwen2"), tensor_parallel_size=4)


@pytest.mark.parametrize("options, words", [
    ({"tensor_parallel_size": 3}, ["tensor_parallel_size=3", "4 attention heads"]),
    ({"tensor_parallel_size": 8}, ["tensor_parallel_size=8", "4 attention heads"]),
    ({"pipeline_parallel_size": 3}, ["pipeline_parallel_size=3", "2 layers"]),
    ({"data_parallel_size": 0}, ["data_parallel_size", "got 0"]),
    ({"distributed_executor_backend": "slurm"}, ["distributed_executor_backend", "'slurm'"]),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, ["'uni'", "'mp'"]),
])
def test_bad_parallel_configs_are_refused_in_one_line(tiny_checkpoint, options, words):
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                           **options))
    message = str(refused.value)
    assert "\n" not in message and all(w in message for w in words), message


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_killed_worker_is_reported_and_nothing_is_left(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=128, tensor_parallel_size=2))
    workers = [p.pid for p in engine.core.executor._procs]  # type: ignore[attr-defined]
    try:
        os.kill(workers[1], signal.SIGKILL)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
        started = time.monotonic()
        with pytest.raises(WorkerDied, match=r"rank 1 .* died \(killed by signal 9\)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 10
    finally:
        engine.shutdown()
    for pid in workers:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_workers_die_with_their_engine(tiny_checkpoint, tmp_path):
    """kill -9 of the engine's process: its workers exit too (no orphans)."""
    script = textwrap.dedent(f"""
        import sys, time
        from quire.config import EngineConfig
        from quire.engine import LLMEngine
        engine = LLMEngine(EngineConfig.from_kwargs({str(tiny_checkpoint("llama"))!r},
                           device="cpu", max_model_len=128, tensor_parallel_size=2))
        print(" ".join(str(p.pid) for p in engine.core.executor._procs), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2, line
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in workers
                 if subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0]
    assert not alive, f"orphan workers: {alive}"


def test_ray_missing_is_refused_in_one_line(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                           tensor_parallel_size=2,
                                           distributed_executor_backend="ray"))
    assert str(refused.value).startswith("distributed_executor_backend='ray' needs Ray")


def test_an_engine_never_shut_down_leaves_nothing_once_collected(tiny_checkpoint):
    import gc

    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=128, tensor_parallel_size=2))
    workers = [p.pid for p in engine.core.executor._procs]  # type: ignore[attr-defined]
    workdir = engine.core.executor._workdir  # type: ignore[attr-defined]
    del engine
    gc.collect()
    assert not os.path.exists(workdir)
    for pid in workers:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
