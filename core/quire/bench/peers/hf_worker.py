"""Hugging Face transformers as a benchmark peer (run in the ``hf`` virtual environment).

Throughput: ``generate`` on left-padded batches of at most ``max_batch_size`` requests,
in request order, greedy, on the job's ``device`` at its ``dtype`` (the device type and
dtype Quire ran at; default cpu and float32). A batch runs until its longest output is done
(static batching), so only each request's own ``output_len`` tokens are counted; the
extra steps are part of the measured time, as they are for any user of ``generate``.
``min_new_tokens`` equal to ``max_new_tokens`` keeps EOS from ending a sequence early.

Latency: one request at a time, with a streamer that timestamps every new token.

Also converts a GGUF file into a safetensors checkpoint (``convert_gguf``), the files
the hf and vllm peers load.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

# this directory's shared modules (the script's directory is on sys.path)
from clock import TokenClock
from procmem import peak_rss_bytes, reset_peak_rss
from worker_io import Job, log, main, throughput_result


def _load(job: Job) -> tuple[Any, float]:
    start = time.perf_counter()
    options = job.get("options", {})
    dtype = getattr(torch, options.get("dtype") or "float32")
    device = torch.device(options.get("device") or "cpu")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).to(device)
    model.eval()
    if device.type == "cuda":
        # float32 means float32 here, as in Quire's kernels: no TF32 products
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    threads = options.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    return model, time.perf_counter() - start


def _synchronize(model: Any) -> None:
    """Wait for the model's device, so that a host clock read after it sees the work done."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _pad_id(model: Any) -> int:
    for value in (model.config.pad_token_id, model.generation_config.pad_token_id,
                  model.config.eos_token_id):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


@torch.inference_mode()
def _generate(model: Any, prompts: list[list[int]], new_tokens: int,
              streamer: Any = None) -> torch.Tensor:
    """Greedy continuation of left-padded ``prompts``; returns only the new tokens."""
    width = max(len(p) for p in prompts)
    pad = _pad_id(model)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=pad, streamer=streamer, temperature=None, top_p=None,
                         top_k=None)
    return out[:, width:]


def _engine(model: Any, batch: int | None = None) -> str:
    shape = f", batches of {batch}" if batch else ""
    where = (torch.cuda.get_device_name(model.device) if model.device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    dtype = str(model.dtype).removeprefix("torch.")
    return f"transformers {transformers.__version__}, torch {torch.__version__}, " \
           f"{dtype}, {where}{shape}"


def throughput(job: Job) -> dict[str, Any]:
    model, load_s = _load(job)
    load_peak = peak_rss_bytes()
    batch = int(job.get("options", {}).get("max_batch_size") or 64)
    _generate(model, [[1, 2, 3, 4, 5, 6, 7, 8]], 4)  # warm-up
    runs = []
    for r, requests in enumerate(job["runs"]):
        reset_peak_rss()
        made = 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch):
            chunk = requests[i:i + batch]
            out = _generate(model, [q["prompt_token_ids"] for q in chunk],
                            max(q["output_len"] for q in chunk))
            made += sum(min(q["output_len"], out.shape[1]) for q in chunk)
        _synchronize(model)
        elapsed = time.perf_counter() - start
        runs.append(throughput_result(elapsed, requests, made, peak_rss_bytes()))
        log(f"run {r + 1}/{len(job['runs'])}: {elapsed:.2f}s")
    return {"engine": _engine(model, batch), "load_s": load_s,
            "peak_rss_load_bytes": load_peak, "runs": runs}


class _Clock(BaseStreamer):
    """Calls ``TokenClock.observe`` for each token ``generate`` streams (after the prompt)."""

    def __init__(self) -> None:
        self.clock = TokenClock()
        self.prompt_seen = False
        self.count = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        self.count += value.numel()
        self.clock.observe(self.count)

    def end(self) -> None:
        pass


def latency(job: Job) -> dict[str, Any]:
    model, load_s = _load(job)
    load_peak = peak_rss_bytes()
    _generate(model, [[1, 2, 3, 4, 5, 6, 7, 8]], 4)  # warm-up
    runs = []
    for requests in job["runs"]:
        reset_peak_rss()
        timings = []
        for q in requests:
            streamer = _Clock()
            _generate(model, [q["prompt_token_ids"]], q["output_len"], streamer)
            timings.append(streamer.clock.timing())
        runs.append({"requests": timings, "peak_rss_bytes": peak_rss_bytes()})
    return {"engine": _engine(model), "load_s": load_s, "peak_rss_load_bytes": load_peak,
            "runs": runs}


def convert_gguf(job: Job) -> dict[str, Any]:
    """Dequantize ``job["model"]`` (a .gguf file) into a float32 safetensors checkpoint
    with its tokenizer, at ``job["output_dir"]``."""
    directory, name = os.path.split(os.path.abspath(job["model"]))
    out = job["output_dir"]
    log(f"converting {name} to a float32 safetensors checkpoint in {out}")
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # The weights are plain float32 tensors now; only the loader's marker says "gguf", and
    # save_pretrained refuses to write a model marked as quantized.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"output_dir": out}


if __name__ == "__main__":
    main({"throughput": throughput, "latency": latency, "convert_gguf": convert_gguf})
