"""vLLM (CPU build) as a benchmark peer (run in the ``vllm`` virtual environment).

Throughput: ``LLM.generate`` over token-id prompts, float32 unless the job's
``vllm_dtype`` says otherwise (``quire bench --vllm-dtype``), greedy, ``ignore_eos`` and
each request's own ``max_tokens``. Latency: one request at a time through the engine
under ``LLM`` (``add_request`` / ``step``), timestamping every step that adds tokens.

vLLM runs its engine core in a child process, so peaks are summed over the process
tree. Start-up takes minutes on a small CPU (torch.compile); it is reported as
``load_s`` and not timed as part of any run.
"""

from __future__ import annotations

import time
from typing import Any

import vllm
from vllm import LLM, SamplingParams

# this directory's shared modules (the script's directory is on sys.path)
from clock import TokenClock
from procmem import peak_rss_bytes, reset_peak_rss
from worker_io import Job, log, main, throughput_result


def _load(job: Job) -> tuple[Any, float]:
    options = job.get("options", {})
    kwargs: dict[str, Any] = {"model": job["model"], "dtype": _dtype(job), "seed": 0}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if options.get(name):
            kwargs[name] = int(options[name])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - start


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def _dtype(job: Job) -> str:
    return job.get("options", {}).get("vllm_dtype") or "float32"


def _engine(job: Job) -> str:
    return f"vLLM {vllm.__version__} (CPU), {_dtype(job)}"


def throughput(job: Job) -> dict[str, Any]:
    llm, load_s = _load(job)
    load_peak = peak_rss_bytes()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}], _params(4),
                 use_tqdm=False)  # warm-up
    runs = []
    for r, requests in enumerate(job["runs"]):
        prompts = [{"prompt_token_ids": q["prompt_token_ids"]} for q in requests]
        params = [_params(q["output_len"]) for q in requests]
        reset_peak_rss()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append(throughput_result(elapsed, requests, made, peak_rss_bytes()))
        log(f"run {r + 1}/{len(job['runs'])}: {elapsed:.2f}s")
    return {"engine": _engine(job), "load_s": load_s, "peak_rss_load_bytes": load_peak,
            "runs": runs}


def _stream_one(engine: Any, request_id: str, q: dict[str, Any]) -> dict[str, Any]:
    clock = TokenClock()
    engine.add_request(request_id, {"prompt_token_ids": q["prompt_token_ids"]},
                       _params(q["output_len"]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:  # outputs are cumulative by default
                clock.observe(len(out.outputs[0].token_ids))
    return clock.timing()


def latency(job: Job) -> dict[str, Any]:
    llm, load_s = _load(job)
    load_peak = peak_rss_bytes()
    engine = llm.llm_engine
    _stream_one(engine, "warmup", {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                                   "output_len": 4})
    runs = []
    for r, requests in enumerate(job["runs"]):
        reset_peak_rss()
        timings = [_stream_one(engine, f"{r}-{i}", q) for i, q in enumerate(requests)]
        runs.append({"requests": timings, "peak_rss_bytes": peak_rss_bytes()})
    return {"engine": _engine(job), "load_s": load_s, "peak_rss_load_bytes": load_peak,
            "runs": runs}


if __name__ == "__main__":
    main({"throughput": throughput, "latency": latency})
