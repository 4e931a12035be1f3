"""llama.cpp as a benchmark peer (run in the ``llamacpp`` virtual environment).

llama-cpp-python's high-level ``Llama`` runs one sequence at a time, so throughput uses
the low-level API instead: one context with ``n_seq_max`` sequences and a float32 KV
cache; each ``llama_decode`` call takes one token of every decoding sequence plus as many
prompt tokens of newly admitted sequences as the batch has room for (continuous
batching). A finished sequence's KV cells are removed and its slot goes to the next
request. Sampling is greedy (``llama_sampler_init_greedy``); EOS is never checked, so
every request makes exactly its ``output_len`` tokens. Latency is the same loop with one
sequence at a time.

Also writes an F32 GGUF from a quantized one (``quantize_f32``, via
``llama_model_quantize`` with requantizing allowed): the same dequantized weights the
other engines run.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L

# this directory's shared modules (the script's directory is on sys.path)
from clock import TokenClock
from procmem import peak_rss_bytes, reset_peak_rss
from worker_io import Job, log, main, throughput_result

GGML_TYPE_F32 = 0
GGML_LOG_LEVEL_ERROR = 4
_DEFAULT_PARALLEL = 64
_DEFAULT_BATCH = 2048
_WARMUP = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_len": 4}


def quiet_logs() -> Any:
    """Pass only llama.cpp's errors on to stderr (it logs every tensor it loads).

    :returns: the C callback, which the caller must keep alive while llama.cpp runs.
    """
    @L.llama_log_callback
    def forward_errors(level: int, text: bytes, user_data: Any) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode(errors="replace"))

    L.llama_log_set(forward_errors, ctypes.c_void_p(0))
    return forward_errors


@dataclass
class _Slot:
    """One sequence id of the context and the request it is running."""

    seq: int
    index: int
    request: dict[str, Any]
    clock: TokenClock = field(default_factory=TokenClock)
    fed: int = 0  # prompt tokens decoded so far
    made: int = 0  # tokens sampled so far
    last: int = 0  # the newest sampled token, decoded in the next step

    @property
    def prefilled(self) -> bool:
        return self.fed == len(self.request["prompt_token_ids"])


def model_params(options: dict[str, Any]) -> Any:
    """llama.cpp's default model parameters, but without its extra buffer types (the AMX
    and other repacked weight layouts) when ``options["repack"]`` is false: its AMX path
    crashes on some hosts, and this keeps its plain CPU kernels measurable there."""
    params = L.llama_model_default_params()
    if not options.get("repack", True) and "use_extra_bufts" in dict(type(params)._fields_):
        params.use_extra_bufts = False
    return params


class _Runner:
    """A loaded model, one context and one batch, reused for every run."""

    def __init__(self, path: str, n_parallel: int, seq_len: int, n_batch: int,
                 threads: int, kv_type: str = "f16", repack: bool = True) -> None:
        self._log_callback = quiet_logs()
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(),
                                                  model_params({"repack": repack}))
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx = n_parallel * seq_len
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = n_parallel
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = _KV_TYPES[kv_type]  # f16: llama.cpp's default
        if "kv_unified" in dict(type(params)._fields_):
            params.kv_unified = True  # one pool for all sequences, not n_ctx / n_seq_max each
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} "
                               f"tokens for {n_parallel} sequences")
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.sampler = L.llama_sampler_init_greedy()
        self.n_parallel, self.n_batch, self.threads = n_parallel, n_batch, threads
        self.kv_type, self.repack = kv_type, repack

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, buf, len(buf))
        return (f"llama.cpp (llama-cpp-python {L.__version__}), {buf.value.decode()}, "
                f"{self.kv_type.upper()} KV cache, {self.threads} threads, "
                f"{self.n_parallel} parallel sequences"
                + ("" if self.repack else ", no repacked weights (extra buffer types off)"))

    # -- KV cells: the memory API, or the kv_self one of older releases ----------------
    def _forget(self, seq: int) -> None:
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), seq, -1, -1)
        else:
            L.llama_kv_self_seq_rm(self.ctx, seq, -1, -1)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
        b.seq_id[i][0] = seq
        b.logits[i] = 1 if logits else 0
        b.n_tokens = i + 1
        return i

    def _fill(self, active: list[_Slot]) -> list[tuple[int, _Slot]]:
        """Put one step into the batch; returns (batch index, slot) of each token to sample."""
        self.batch.n_tokens = 0
        wants = []
        for s in active:  # decoding sequences first: one token each
            if s.prefilled and s.made:
                pos = s.fed + s.made - 1
                wants.append((self._add(s.last, pos, s.seq, True), s))
        for s in active:  # then prompt tokens, as many as fit
            prompt = s.request["prompt_token_ids"]
            while not s.prefilled and self.batch.n_tokens < self.n_batch:
                last = s.fed == len(prompt) - 1
                index = self._add(prompt[s.fed], s.fed, s.seq, last)
                s.fed += 1
                if last:
                    wants.append((index, s))
        return wants

    def run(self, requests: list[dict[str, Any]], n_parallel: int) -> list[dict[str, Any]]:
        """Every request to completion, at most ``n_parallel`` at once; their timings."""
        pending = deque(enumerate(requests))
        free = list(range(n_parallel))
        active: list[_Slot] = []
        timings: list[dict[str, Any]] = [{}] * len(requests)
        while pending or active:
            while pending and free:
                index, request = pending.popleft()
                active.append(_Slot(free.pop(), index, request))
            wants = self._fill(active)
            rc = L.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")
            for index, s in wants:
                s.last = L.llama_sampler_sample(self.sampler, self.ctx, index)
                s.made += 1
                s.clock.observe(s.made)
                if s.made == s.request["output_len"]:
                    self._forget(s.seq)
                    free.append(s.seq)
                    active.remove(s)
                    timings[s.index] = s.clock.timing()
        return timings


def _runner(job: Job, n_parallel: int) -> tuple[_Runner, float]:
    options = job.get("options", {})
    seq_len = max(len(q["prompt_token_ids"]) + q["output_len"]
                  for requests in job["runs"] for q in requests) + 8
    start = time.perf_counter()
    runner = _Runner(job["model"], n_parallel, seq_len,
                     int(options.get("n_batch") or _DEFAULT_BATCH),
                     int(options.get("threads") or os.cpu_count() or 1),
                     options.get("kv_type", "f16"), bool(options.get("repack", True)))
    return runner, time.perf_counter() - start


def throughput(job: Job) -> dict[str, Any]:
    longest = max(len(requests) for requests in job["runs"])
    n_parallel = min(longest, int(job.get("options", {}).get("n_parallel") or _DEFAULT_PARALLEL))
    runner, load_s = _runner(job, n_parallel)
    load_peak = peak_rss_bytes()
    runner.run([_WARMUP], 1)
    runs = []
    for r, requests in enumerate(job["runs"]):
        reset_peak_rss()
        start = time.perf_counter()
        timings = runner.run(requests, n_parallel)
        elapsed = time.perf_counter() - start
        made = sum(t["output_tokens"] for t in timings)
        runs.append(throughput_result(elapsed, requests, made, peak_rss_bytes()))
        log(f"run {r + 1}/{len(job['runs'])}: {elapsed:.2f}s")
    return {"engine": runner.describe(), "load_s": load_s, "peak_rss_load_bytes": load_peak,
            "runs": runs}


def latency(job: Job) -> dict[str, Any]:
    runner, load_s = _runner(job, 1)
    load_peak = peak_rss_bytes()
    runner.run([_WARMUP], 1)
    runs = []
    for requests in job["runs"]:
        reset_peak_rss()
        timings = [runner.run([q], 1)[0] for q in requests]
        runs.append({"requests": timings, "peak_rss_bytes": peak_rss_bytes()})
    return {"engine": runner.describe(), "load_s": load_s, "peak_rss_load_bytes": load_peak,
            "runs": runs}


def quantize_f32(job: Job) -> dict[str, Any]:
    """Write ``job["output"]``: ``job["model"]`` with every tensor in F32."""
    out = job["output"]
    partial = out + ".partial"
    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True  # the source is already quantized
    log(f"writing an F32 copy of {job['model']} to {out}")
    keep_alive = quiet_logs()  # noqa: F841 - llama.cpp calls it until we return
    rc = L.llama_model_quantize(job["model"].encode(), partial.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    os.replace(partial, out)
    return {"output": out}


GGML_TYPE_F16 = 1
_KV_TYPES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16}


def _n_vocab(model: Any) -> int:
    if hasattr(L, "llama_model_get_vocab"):
        return int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
    return int(L.llama_n_vocab(model))  # releases before the vocab API


def logits(job: Job) -> dict[str, Any]:
    """Write to ``job["output"]`` the float32 logits ``[n-1, n_vocab]`` of positions
    ``0 .. n-2`` of ``job["token_ids"]`` (one sequence, fed as given: no BOS added), for
    ``quire bench accuracy``. Chunks of ``n_batch`` tokens, each reading the KV cache the
    earlier ones wrote; KV cache type ``kv_type`` (f16, llama.cpp's default, or f32)."""
    ids = [int(t) for t in job["token_ids"]]
    options = job.get("options", {})
    n = len(ids)
    n_batch = max(1, min(int(options.get("n_batch") or 512), n))
    threads = int(options.get("threads") or os.cpu_count() or 1)
    keep_alive = quiet_logs()  # noqa: F841 - llama.cpp calls it until we return
    start = time.perf_counter()
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["model"].encode(), model_params(options))
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['model']}")
    params = L.llama_context_default_params()
    params.n_ctx = n
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = 1
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = _KV_TYPES[options.get("kv_type", "f16")]
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context of {n} tokens")
    load_s = time.perf_counter() - start
    vocab = _n_vocab(model)
    batch = L.llama_batch_init(n_batch, 0, 1)
    partial = job["output"] + ".partial"
    with open(partial, "wb") as out:
        for first in range(0, n - 1, n_batch):
            k = min(n_batch, n - 1 - first)
            batch.n_tokens = k
            for i in range(k):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = ids[first + i], first + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            out.write(ctypes.string_at(L.llama_get_logits(ctx), k * vocab * 4))
    os.replace(partial, job["output"])
    desc = ctypes.create_string_buffer(256)
    L.llama_model_desc(model, desc, len(desc))
    kv = options.get("kv_type", "f16").upper()
    return {"engine": f"llama.cpp (llama-cpp-python {L.__version__}), "
                      f"{desc.value.decode()}, {kv} KV cache, {threads} threads",
            "load_s": load_s, "n_vocab": vocab, "rows": n - 1}


if __name__ == "__main__":
    main({"throughput": throughput, "latency": latency, "quantize_f32": quantize_f32,
          "logits": logits})
