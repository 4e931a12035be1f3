"""The cuda platform: NVIDIA GPUs through a CUDA build of torch.

Attention is the core's :class:`~quire.kernels.TritonAttentionBackend` (portable Triton
kernels); collectives are the core's ``TorchDistributedCommunicator`` over NCCL. What is
NVIDIA-specific lives here: detection, and sizing the split-K decode to the GPU's SMs.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, GraphCapture, Platform
from quire.kernels import TritonAttentionBackend, TritonAttentionConfig
from quire.kernels.triton_ops import triton_ops
from quire.ops import OpSet, reference_ops
from quire_cuda.memory import CudaMemoryProfiler

#: Decode programs to aim for, per SM: enough resident programs to hide memory latency.
DECODE_PROGRAMS_PER_SM = 4


class CudaPlatform(Platform):
    """NVIDIA GPUs. Creating one touches no device; :meth:`availability` probes lazily."""

    name = "cuda"
    device_type = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    distributed_backend = "nccl"
    # bfloat16 first: the usual checkpoint dtype, with float32's range. (Pre-Ampere GPUs
    # have no native bfloat16; that is not probed here.)
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    default_block_size = 16
    priority = 100
    #: the shared Triton kernels (quire.kernels.triton_quant) dequantise every GGUF
    #: format and int8/fp8 rows in registers, and run w8a8 on int8 tensor cores; fp8 is
    #: weight-only (e4m3 dequantised in the product). Checked under TRITON_INTERPRET=1
    #: only: no GPU run yet.
    quantizations = ("none", "gguf", "int8", "w8a8", "fp8")

    def availability(self) -> Availability:
        """Checks, in order: torch's build, the driver and devices, then triton."""
        if torch.version.hip is not None:
            return Availability.no("this is a ROCm build of torch; use the rocm platform")
        if torch.version.cuda is None:
            return Availability.no(
                f"torch {torch.__version__} was built without CUDA "
                "(torch.version.cuda is None); install a CUDA build of torch"
            )
        count, driver_error = _probe_device_count()
        if driver_error is not None:
            return Availability.no(f"driver error: {driver_error}")
        if count == 0:
            return Availability.no(f"no CUDA device found{_visible_note()}")
        if not _triton_installed():
            return Availability.no(
                "triton is not installed; the cuda platform's attention kernels are "
                "written in Triton (pip install triton)"
            )
        return Availability.yes()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def graph_capture(self, device_index: int = 0) -> GraphCapture:
        """CUDA graphs of the decode forward, one memory pool per worker (imported here,
        so listing the platform stays cheap). Untested on a GPU so far."""
        from quire.kernels.torch_graphs import TorchGraphCapture

        return TorchGraphCapture(device_index)

    def make_ops(self) -> OpSet:
        """The reference ops with the core's Triton kernels (portable, imported on
        their first call): RMSNorm with the residual add, the gated activations and
        ``fused_moe``."""
        return reference_ops().with_ops("triton", **triton_ops())

    def make_attention_backend(self) -> TritonAttentionBackend:
        """The core's Triton backend; decode is split along the keys until it fills the SMs.

        With no device visible (the kernels then run on host tensors in Triton's
        interpreter, as the conformance suite's kernels-only mode does) there is no SM
        count to read, and the core's default split target stands.
        """
        if not torch.cuda.is_available():
            return TritonAttentionBackend()
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return TritonAttentionBackend(
            TritonAttentionConfig(decode_split_target=DECODE_PROGRAMS_PER_SM * sms)
        )

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """NCCL collectives and send/recv; for ``world_size > 1`` the caller initialised
        the group."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> CudaMemoryProfiler:
        return CudaMemoryProfiler(device_index)


def _probe_device_count() -> tuple[int, str | None]:
    """(visible devices, driver error or None), without creating a CUDA context.

    ``torch.cuda.device_count`` reports a failed driver query as 0 devices plus a
    "CUDA initialization: ..." warning (a driver too old, none installed); that warning's
    text, or an exception's, is the precise reason.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            count = int(torch.cuda.device_count())
        except Exception as err:  # noqa: BLE001 -- any failure here is the reason shown
            return 0, f"{type(err).__name__}: {err}"
    if count == 0:
        for warning in caught:
            text = str(warning.message)
            if "CUDA initialization" in text:
                return 0, text.removeprefix("CUDA initialization: ")
    return count, None


def _visible_note() -> str:
    value = os.environ.get(CudaPlatform.visible_devices_env or "")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value!r})"


def _triton_installed() -> bool:
    """Whether triton can be imported; finds it without importing it."""
    return importlib.util.find_spec("triton") is not None
