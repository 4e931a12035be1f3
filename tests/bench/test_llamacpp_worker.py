"""The llama.cpp worker's continuous batching, against a fake ``llama_cpp`` module.

The fake model checks what llama.cpp would: every token of a sequence arrives at the
next position of that sequence, logits are read only where the batch asked for them,
and a sequence id is cleared before it is reused. Its "next token" depends only on the
sequence's own history, so a batched run must give every request the same tokens as a
one-at-a-time run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import quire.bench.peers.procmem as procmem

PEERS_DIR = str(Path(procmem.__file__).parent)


class FakeLlama:
    """The parts of llama_cpp the worker calls."""

    __version__ = "fake"
    LLAMA_FTYPE_ALL_F32 = 0

    def __init__(self) -> None:
        self.history: dict[int, list[int]] = {}
        self.finished: list[list[int]] = []
        self.batch_sizes: list[int] = []

    # -- set-up ----------------------------------------------------------------------------
    @staticmethod
    def llama_log_callback(function):
        return function

    def llama_log_set(self, callback, user_data):
        self.log_callback = callback

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        return "model"

    def llama_context_default_params(self):
        class Params:
            _fields_ = [("n_ctx", None), ("kv_unified", None)]

        return Params()

    def llama_init_from_model(self, model, params):
        self.params = params
        return "ctx"

    def llama_batch_init(self, n, embd, n_seq_max):
        return SimpleNamespace(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                               seq_id=[[0] for _ in range(n)], logits=[0] * n)

    def llama_sampler_init_greedy(self):
        return "greedy"

    def llama_model_desc(self, model, buf, size):
        buf.value = b"fake 1M F32"

    # -- running ---------------------------------------------------------------------------
    def llama_decode(self, ctx, batch):
        self.batch_sizes.append(batch.n_tokens)
        self.batch = batch
        self.snapshots = {}
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            history = self.history.setdefault(seq, [])
            assert batch.pos[i] == len(history), f"seq {seq}: position {batch.pos[i]}"
            history.append(batch.token[i])
            if batch.logits[i]:
                self.snapshots[i] = list(history)
        return 0

    def llama_sampler_sample(self, sampler, ctx, index):
        assert index in self.snapshots, "logits read where none were asked for"
        history = self.snapshots[index]
        return (sum(history) * 31 + len(history)) % 997

    def llama_get_memory(self, ctx):
        return "memory"

    def llama_memory_seq_rm(self, memory, seq, p0, p1):
        assert (p0, p1) == (-1, -1)
        self.finished.append(self.history.pop(seq))
        return True


@pytest.fixture
def worker(monkeypatch):
    fake = FakeLlama()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.syspath_prepend(PEERS_DIR)
    for name in ("llamacpp_worker", "worker_io", "clock", "procmem"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("llamacpp_worker")
    yield module, fake
    sys.modules.pop("llamacpp_worker", None)


REQUESTS = [{"prompt_token_ids": list(range(10 * i + 1, 10 * i + 1 + n)), "output_len": m}
            for i, (n, m) in enumerate([(5, 3), (13, 1), (2, 6), (9, 4), (7, 2)])]


def test_batched_run_matches_one_at_a_time(worker):
    module, fake = worker
    runner = module._Runner("model.gguf", n_parallel=3, seq_len=32, n_batch=8, threads=1)
    assert fake.params.kv_unified is True and fake.params.n_ctx == 96
    timings = runner.run(REQUESTS, n_parallel=3)
    batched = sorted(fake.finished)
    assert [t["output_tokens"] for t in timings] == [3, 1, 6, 4, 2]
    assert max(fake.batch_sizes) <= 8  # prompts longer than the batch are split
    assert not fake.history  # every sequence was cleared

    fake.finished.clear()
    for request in REQUESTS:
        runner.run([request], n_parallel=1)
    assert sorted(fake.finished) == batched
    # what stays in a sequence's cache: its prompt and all but its last sampled token
    for request, history in zip(REQUESTS, fake.finished):
        assert len(history) == len(request["prompt_token_ids"]) + request["output_len"] - 1


def test_throughput_job_counts_every_requested_token(worker):
    module, fake = worker
    job = {"action": "throughput", "model": "m.gguf", "runs": [REQUESTS, REQUESTS[:2]],
           "options": {"n_parallel": 2, "n_batch": 16, "threads": 1}}
    result = module.throughput(job)
    assert [r["output_tokens"] for r in result["runs"]] == [16, 4]
    assert [r["num_requests"] for r in result["runs"]] == [5, 2]
    assert "fake 1M F32" in result["engine"] and "2 parallel" in result["engine"]
    latency = module.latency({**job, "runs": [REQUESTS[:2]]})
    assert [t["output_tokens"] for t in latency["runs"][0]["requests"]] == [3, 1]


def test_repack_off_turns_llama_cpps_extra_buffer_types_off(worker):
    """``--llamacpp-repack off`` loads the model with ``use_extra_bufts`` false (its AMX
    repacking crashes on some hosts); on by default, llama.cpp's own default."""
    module, fake = worker

    class Params:
        _fields_ = [("use_extra_bufts", None)]

        def __init__(self) -> None:
            self.use_extra_bufts = True

    loaded = []
    fake.llama_model_default_params = Params
    fake.llama_model_load_from_file = lambda path, params: loaded.append(params) or "model"
    module._Runner("m.gguf", n_parallel=1, seq_len=8, n_batch=8, threads=1)
    runner = module._Runner("m.gguf", n_parallel=1, seq_len=8, n_batch=8, threads=1,
                            repack=False)
    assert [p.use_extra_bufts for p in loaded] == [True, False]
    assert "no repacked weights" in runner.describe()
