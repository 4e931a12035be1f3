"""Device graphs through torch's ``torch.cuda.graph`` API, shared by the cuda and rocm
plugins: a ROCm build of torch records HIP graphs through the same calls, so, as with the
Triton kernels beside it, one recorder serves both vendors and neither plugin imports the
other.

Imported by the plugins' ``graph_capture`` only. Creating a :class:`TorchGraphCapture`
touches no device: the memory pool is made at the first capture. Untested on a GPU so
far (docs/backends/cuda-rocm.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quire.interfaces.platform import GraphCapture


class TorchGraphCapture(GraphCapture):
    """``torch.cuda.CUDAGraph`` captures on one device (CUDA graphs, or HIP graphs on a
    ROCm build), sharing one memory pool."""

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cuda", device_index)
        self._pool: tuple[int, int] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with torch.cuda.device(self.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # torch's recipe: one run on a side stream first (libraries set up their
            # per-stream state there, not inside the capture), then capture on its own
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = fn()
            torch.cuda.synchronize()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
