"""Where an engine step's time goes: torch.profiler over decode steps of a full batch.

    python scripts/profile_steps.py --model PATH --device cpu --batch 64 --prompt-len 128

Adds ``--batch`` requests of ``--prompt-len`` distinct random tokens (greedy,
``ignore_eos``), runs steps until every prompt is in the cache, then profiles
``--steps`` pure decode steps. Prints the median step time and the top entries by self
host time; on a GPU also by self device time, how busy the device was, and the kernel
launches per step (host launch calls, a graph's replay counting as one) beside the
kernels that ran per step (``--enforce-eager`` compares without graphs). Torch
operators and CUDA kernels are all the profiler sees: time spent in the cpu platform's C
kernels (called through ctypes) shows up as the host time of the Python frame around
them, so for the cpu platform use py-spy with ``--native`` as well.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from quire.engine import LLMEngine
from quire.entrypoints.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
)
from quire.plugins.registry import PlatformRegistry
from quire.sampling_params import SamplingParams
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

#: Runtime calls that launch device work (CUDA and HIP names): a graph's replay is one.
LAUNCH_CALLS = ("LaunchKernel", "cuLaunchKernel", "GraphLaunch", "hipModuleLaunchKernel",
                "hipExtModuleLaunchKernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser)  # --model, --device, --dtype, --kv-cache-memory, ...
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="decode steps to profile")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    engine = LLMEngine(engine_config_from_args(args), PlatformRegistry())
    platform = engine.core.platform
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0.0)
    for _ in range(args.batch):
        prompt = torch.randint(10, engine.vocab_size, (args.prompt_len,), generator=gen)
        engine.add_request(prompt.tolist(), params)

    # Prompt steps until every sequence has its first token, then a few decode steps
    # to warm up (lazy compiles, allocator growth).
    made = 0
    while made < args.batch:
        made += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)
    for _ in range(3):
        engine.step()

    activities = [ProfilerActivity.CPU]
    on_gpu = platform.device_type == "cuda"
    if on_gpu:
        activities.append(ProfilerActivity.CUDA)
    step_s = []
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            platform.synchronize()
            step_s.append(time.perf_counter() - start)
    wall = sum(step_s)
    print(f"{platform.name}, {args.batch} sequences, {args.steps} decode steps: "
          f"median {statistics.median(step_s) * 1e3:.2f} ms per step")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if on_gpu:
        print(table.table(sort_by="self_device_time_total", row_limit=args.top))
        # kernels only: operator rows repeat their kernels' device time
        busy = sum(e.self_device_time_total for e in table
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e6
        print(f"device busy {busy:.3f} s of {wall:.3f} s wall ({busy / wall:.0%})")
        kernels = sum(e.count for e in table
                      if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
        launches = sum(e.count for e in table if e.device_type == DeviceType.CPU
                       and any(name in e.key for name in LAUNCH_CALLS))
        print(f"launches per step {launches / args.steps:.0f}, kernels per step "
              f"{kernels / args.steps:.0f}")


if __name__ == "__main__":
    main()
