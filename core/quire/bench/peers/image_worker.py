"""The image workload (``quire bench images``) in a peer: transformers or vLLM, whichever
the venv running this script has (the job's ``options.engine``: "hf" or "vllm").

A job (see :func:`quire.bench.images.peer_job`) holds a warm-up pass and one pass per
repeat, each ``{"single": {"prompt", "image"}, "batch": [...], "output_len"}``, images
as PNG paths. Images are decoded before any clock starts; prompts and images are handed
to the engine's own preprocessing, which the times include. Per pass the result holds
what :class:`quire.bench.images.ImageRun` takes:

- transformers: ``AutoProcessor`` then ``generate``. TTFT: one request,
  ``max_new_tokens=1``; the encoder's time: forward hooks on the vision tower and the
  projector during it; no prefix cache (``ttft_cached_s`` None); the batch: one
  left-padded ``generate`` of all its requests, ``min_new_tokens`` = ``max_new_tokens``.
- vLLM: ``LLM.generate`` with ``multi_modal_data``, prefix caching on. TTFT: one request,
  ``max_tokens=1``, then the same again (``num_cached_tokens``); the encoder runs in
  the engine-core process, out of reach (``encoder_s`` None).
"""

from __future__ import annotations

import time
from typing import Any

from PIL import Image

# this directory's shared modules (the script's directory is on sys.path)
from worker_io import Job, log, main


def _images(p: dict[str, Any]) -> dict[str, Any]:
    paths = {p["single"]["image"], *(r["image"] for r in p["batch"])}
    out = {}
    for path in paths:
        with Image.open(path) as image:
            out[path] = image.convert("RGB")
    return out


def _run(job: Job, engine: Any) -> dict[str, Any]:
    start = time.perf_counter()
    engine.load(job)
    load_s = time.perf_counter() - start
    engine.run(job["warmup"], _images(job["warmup"]))
    runs = []
    for r, p in enumerate(job["runs"]):
        runs.append(engine.run(p, _images(p)))
        log(f"run {r + 1}/{len(job['runs'])}: TTFT {runs[-1]['ttft_s']:.3f}s, "
            f"batch {runs[-1]['elapsed_s']:.2f}s")
    return {"engine": engine.describe(), "load_s": load_s, "runs": runs}


class _HF:
    """transformers ``generate``."""

    def load(self, job: Job) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch = torch
        self.model = AutoModelForImageTextToText.from_pretrained(
            job["model"], dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(job["model"])
        self.processor.tokenizer.padding_side = "left"
        tokenizer = self.processor.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        inner = getattr(self.model, "model", self.model)
        self.encoder_s = 0.0
        for module in (inner.vision_tower, inner.multi_modal_projector):
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, module: Any, args: Any) -> None:
        module._quire_start = time.perf_counter()

    def _leave(self, module: Any, args: Any, out: Any) -> None:
        self.encoder_s += time.perf_counter() - module._quire_start

    def _generate(self, prompts: list[str], images: list[Any], new_tokens: int) -> Any:
        with self.torch.inference_mode():
            inputs = self.processor(text=prompts, images=images, padding=True,
                                    return_tensors="pt")
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=self.pad,
                                      temperature=None, top_p=None, top_k=None)
        return inputs["input_ids"].shape[1], out[:, inputs["input_ids"].shape[1]:]

    def run(self, p: dict[str, Any], images: dict[str, Any]) -> dict[str, Any]:
        single = p["single"]
        self.encoder_s = 0.0
        start = time.perf_counter()
        width, _ = self._generate([single["prompt"]], [images[single["image"]]], 1)
        ttft = time.perf_counter() - start
        encoder_s = self.encoder_s
        start = time.perf_counter()
        _, made = self._generate([r["prompt"] for r in p["batch"]],
                                 [images[r["image"]] for r in p["batch"]], p["output_len"])
        elapsed = time.perf_counter() - start
        return {"ttft_s": ttft, "prompt_tokens": width, "elapsed_s": elapsed,
                "num_requests": len(p["batch"]), "output_tokens": int(made.numel()),
                "encoder_s": encoder_s}

    def describe(self) -> str:
        import transformers

        return (f"transformers {transformers.__version__}, torch {self.torch.__version__}, "
                f"float32, {self.torch.get_num_threads()} threads, no prefix cache")


class _VLLM:
    """vLLM's ``LLM.generate``, prefix caching on."""

    def load(self, job: Job) -> None:
        from vllm import LLM

        options = job.get("options", {})
        kwargs: dict[str, Any] = {"model": job["model"], "dtype": "float32", "seed": 0,
                                  "enable_prefix_caching": True,
                                  "limit_mm_per_prompt": {"image": 1}}
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if options.get(name):
                kwargs[name] = int(options[name])
        self.llm = LLM(**kwargs)

    def _generate(self, requests: list[dict[str, Any]], images: dict[str, Any],
                  new_tokens: int) -> list[Any]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        prompts = [{"prompt": r["prompt"], "multi_modal_data": {"image": images[r["image"]]}}
                   for r in requests]
        return self.llm.generate(prompts, params, use_tqdm=False)

    def run(self, p: dict[str, Any], images: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        fresh = self._generate([p["single"]], images, 1)[0]
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        again = self._generate([p["single"]], images, 1)[0]
        ttft_cached = time.perf_counter() - start
        start = time.perf_counter()
        outs = self._generate(p["batch"], images, p["output_len"])
        elapsed = time.perf_counter() - start
        return {"ttft_s": ttft, "prompt_tokens": len(fresh.prompt_token_ids),
                "elapsed_s": elapsed, "num_requests": len(p["batch"]),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "ttft_cached_s": ttft_cached, "cached_tokens": again.num_cached_tokens}

    def describe(self) -> str:
        import vllm

        return f"vLLM {vllm.__version__} (CPU), float32, prefix caching"


def images(job: Job) -> dict[str, Any]:
    engine = job.get("options", {}).get("engine")
    if engine not in ("hf", "vllm"):
        raise SystemExit(f"options.engine must be 'hf' or 'vllm', got {engine!r}")
    return _run(job, _HF() if engine == "hf" else _VLLM())


if __name__ == "__main__":  # vLLM starts its engine core by spawning: guard the entry
    main({"images": images})
