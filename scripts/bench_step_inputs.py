"""A decode step's inputs and cpu attention metadata, timed alone (best of 5 x 200).

``python scripts/bench_step_inputs.py`` times this checkout's persistent input batch;
``PYTHONPATH=<a checkout of 1879f5b>/core python scripts/bench_step_inputs.py --old``
times the runner that rebuilt every step from whole page tables. Synthetic decode
steps: 1, 64 and 256 sequences of 41 tokens, three pages each, one torch thread.
"""

from __future__ import annotations

import argparse
import timeit

import torch
from quire.executor.messages import StepItem
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend


def _prepare(batch: int, old: bool):
    if old:  # StepItem(token_ids, start, block_table, samples) and ModelRunner.prepare
        from quire.executor.model_runner import ModelRunner

        runner = ModelRunner.__new__(ModelRunner)
        runner.block_size, runner.device = 16, torch.device("cpu")
        items = [StepItem([5], 40, [3 * i, 3 * i + 1, 3 * i + 2], True)  # type: ignore[call-arg]
                 for i in range(batch)]
        return lambda: runner.prepare(items)
    from quire.executor.input_batch import InputBatch, StepLimits

    inputs = InputBatch(16, torch.device("cpu"), StepLimits(256, 2048, 512))
    inputs.prepare([StepItem(i, [5] * 40, 0, [3 * i, 3 * i + 1, 3 * i + 2], True)
                    for i in range(batch)])
    items = [StepItem(i, [5], 40, [], True, first_page=3) for i in range(batch)]
    return lambda: inputs.prepare(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", action="store_true", help="the runner before 5cbcdef")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backend = CpuSdpaAttentionBackend()
    for batch in (1, 64, 256):
        prepare = _prepare(batch, args.old)

        def best(fn) -> float:
            return min(timeit.repeat(fn, number=200, repeat=5)) / 200 * 1e3

        print(f"batch {batch:3d}: inputs {best(prepare):.3f} ms, inputs + metadata "
              f"{best(lambda: backend.build_metadata(prepare().batch)):.3f} ms")


if __name__ == "__main__":
    main()
