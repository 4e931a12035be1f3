"""Whole-prompt attention on the cpu platform: the C kernel (csrc/prompt_attention.c)
against torch's SDPA one prompt at a time (the backend's path without the kernel), in
milliseconds per layer.

``OMP_WAIT_POLICY=PASSIVE python scripts/bench_prompt_attention.py`` times both on
SmolLM2's heads (Hq=9, Hkv=3, D=64) for W1's prompt step (64 prompts of 128 tokens),
one 2048-token step of W3-like prompts (16 of 128, 8 of 256) and one prompt of 2048,
float32 and bfloat16, q/k/v as views into one fused projection as a layer passes them;
interleaved round after round, each cell its best round.
"""

from __future__ import annotations

import argparse
import os

import torch
from kernel_ab import best_seconds
from quire.platforms.cpu.native import load_native_kernels
from quire.platforms.cpu.sdpa_attention import _fresh_prompt
from quire.platforms.cpu.threads import configure_threads

HQ, HKV, D = 9, 3, 64
CASES = {"64 x 128": [128] * 64, "16 x 128 + 8 x 256": [128] * 16 + [256] * 8,
         "1 x 2048": [2048]}


def _inputs(lens: list[int], dtype: torch.dtype, gen: torch.Generator) -> tuple:
    total = sum(lens)
    qkv = torch.randn(total, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return (q.view(total, HQ, D), k.view(total, HKV, D), v.view(total, HKV, D),
            tuple(zip(starts, lens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per cell")
    args = parser.parse_args()
    kernels = load_native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not load here")
    gen = torch.Generator().manual_seed(0)
    cases = [(name, dtype, _inputs(lens, dtype, gen)) for name, lens in CASES.items()
             for dtype in (torch.float32, torch.bfloat16)]
    scale = D ** -0.5

    def sdpa(q, k, v, prompts):
        return torch.cat([_fresh_prompt(q, (k, v), rows, scale) for rows in prompts])

    def kernel(q, k, v, prompts):
        return kernels.prompt_attention(q, k, v, prompts, scale, None)

    best: dict = {}
    for _ in range(args.rounds):
        for threads in args.threads:
            configure_threads(threads)
            for name, dtype, inputs in cases:
                for which, call in (("sdpa", sdpa), ("kernel", kernel)):
                    took = best_seconds(lambda: call(*inputs), args.budget)
                    key = (threads, name, dtype, which)
                    best[key] = min(best.get(key, float("inf")), took)
    print(f"level {kernels.level}, best of {args.rounds} rounds, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("threads  dtype     case                 sdpa ms  kernel ms  sdpa/kernel")
    for threads in args.threads:
        for name, dtype, _ in cases:
            base = best[(threads, name, dtype, "sdpa")] * 1e3
            new = best[(threads, name, dtype, "kernel")] * 1e3
            kind = str(dtype).removeprefix("torch.")
            print(f"{threads:7d}  {kind:8s}  {name:18s} {base:9.2f} {new:10.2f} "
                  f"{base / new:12.2f}")


if __name__ == "__main__":
    main()
