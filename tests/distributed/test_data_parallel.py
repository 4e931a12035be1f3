"""Data parallelism: ``data_parallel_size`` engine core processes behind one front. Greedy
output equals one process and transformers token for token whichever replica ran it;
requests are spread by load and kept on the replica holding their prefix; a core killed
with ``kill -9`` is reported within seconds and nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.engine.core_proc import EngineCoreDied
from tiny_models import ARCHS, hf_greedy, hf_model

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33], list(range(3, 40)), [5] * 20,
           [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(60, 90))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _alive(pid: int) -> bool:
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0


def _check_against_oracles(path, **options) -> None:
    hf = hf_model(path)
    expected = [hf_greedy(hf, p, 10) for p in PROMPTS]
    with LLM(str(path), device="cpu", max_model_len=128, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        placed = llm.engine.client.placement.placed
    assert got == expected
    assert all(placed), f"a replica took no request: {placed}"


def test_dp2_llama_equals_transformers_on_both_replicas(tiny_checkpoint):
    _check_against_oracles(tiny_checkpoint("llama"), data_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_dp2_every_architecture(tiny_checkpoint, arch):
    _check_against_oracles(tiny_checkpoint(arch), data_parallel_size=2)


@pytest.mark.slow
def test_dp2_x_tp2_equals_transformers(tiny_checkpoint):
    """2 replicas x 2 ranks: 2 core processes, each with 2 worker processes."""
    _check_against_oracles(tiny_checkpoint("llama"), data_parallel_size=2,
                           tensor_parallel_size=2)


def test_dp2_stop_strings_logprobs_and_n_across_processes(tiny_checkpoint):
    """What the front does (text, stop strings, logprob texts, samples of n) gives the
    same outputs when the core runs in another process."""
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, logprobs=2,
                            prompt_logprobs=1, stop=["e", "a"])
    with LLM(path, device="cpu", max_model_len=128) as llm:
        alone = llm.generate(PROMPTS[:3], params)
    with LLM(path, device="cpu", max_model_len=128, data_parallel_size=2) as llm:
        split = llm.generate(PROMPTS[:3], params)
    for a, b in zip(alone, split):
        _same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert (ca.text, ca.token_ids, ca.finish_reason, ca.stop_reason) == \
                   (cb.text, cb.token_ids, cb.finish_reason, cb.stop_reason)
            _same_logprobs(ca.logprobs, cb.logprobs)


def _same_logprobs(a, b) -> None:
    """Same tokens, ranks and texts; values within float32 noise (a core process runs
    torch on fewer threads, and batches differ, so sums are ordered differently)."""
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        if pa is None or pb is None:
            assert pa is pb
            continue
        assert pa.keys() == pb.keys()
        for tid in pa:
            assert (pa[tid].rank, pa[tid].decoded_token) == (pb[tid].rank, pb[tid].decoded_token)
            assert pa[tid].logprob == pytest.approx(pb[tid].logprob, abs=1e-4)


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(tiny_checkpoint("llama")), device="cpu", max_model_len=256, block_size=4,
        data_parallel_size=2))
    try:
        system = list(range(10, 74))  # 16 pages of 4
        for i in range(6):
            engine.add_request(system + [100 + i, 3], GREEDY)
            while engine.has_unfinished_requests():
                engine.step()
        stats = engine.client.stats()
        placed = engine.client.placement.placed
        assert sorted(placed) == [0, 6], placed
        home = placed.index(6)
        assert stats[home].prefix_hits >= 5 * len(system) - 4, stats
    finally:
        engine.shutdown()


def test_a_killed_core_is_reported_and_nothing_is_left(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=128, data_parallel_size=2))
    cores = engine.client._owned.pids  # type: ignore[attr-defined]
    workdir = engine.client.workdir  # type: ignore[attr-defined]
    try:
        os.kill(cores[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineCoreDied, match=r"engine core 1 .*killed by signal 9"):
            for prompt in PROMPTS:
                engine.add_request(prompt, GREEDY)
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 10
    finally:
        engine.shutdown()
    assert not any(_alive(pid) for pid in cores)
    assert not os.path.exists(workdir)


def test_a_core_that_cannot_start_is_refused_in_one_line(tiny_checkpoint):
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                           data_parallel_size=2, tensor_parallel_size=3))
    message = str(refused.value)
    assert "\n" not in message and "tensor_parallel_size=3" in message, message


def test_replicas_on_one_host_share_its_free_memory(tiny_checkpoint, monkeypatch):
    """Host RAM is one pool: a replica's ranks take 1 / data_parallel_size of their
    share, so that replicas started together cannot overcommit it."""
    from quire.executor.worker import Worker
    from quire.interfaces.memory import MemoryProfiler

    monkeypatch.setattr(MemoryProfiler, "kv_budget", lambda self, requested, peak=0: 1 << 26)
    path = str(tiny_checkpoint("llama"))

    def pages(dp: int) -> int:
        worker = Worker(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128,
                                                 data_parallel_size=dp), 0, 1)
        return worker.num_kv_blocks()

    one, two = pages(1), pages(2)
    assert two == one // 2 and two > 0, (one, two)
