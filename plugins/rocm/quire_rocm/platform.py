"""The rocm platform: AMD GPUs through a ROCm build of torch.

ROCm torch keeps CUDA's names: tensors live on ``torch.device("cuda")``, ``torch.cuda``
drives HIP, and the ``torch.distributed`` backend called ``"nccl"`` is RCCL. Attention is
the core's :class:`~quire.kernels.TritonAttentionBackend` (the same Triton source as on
NVIDIA); only detection and launch parameters differ, and they are all here.
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
from quire_rocm.memory import RocmMemoryProfiler

#: Decode programs to aim for, per compute unit.
DECODE_PROGRAMS_PER_CU = 4


def attention_config(compute_units: int | None) -> TritonAttentionConfig:
    """Launch parameters for AMD GPUs: starting points, not yet measured on hardware.

    A wavefront is 64 lanes, so 4 warps are 256 threads, twice a 4-warp NVIDIA program:
    the same tiles give each lane half the elements, which leaves room for 64-key tiles.
    One pipeline stage: the least LDS (64 KiB per compute unit on CDNA GPUs); whether
    more stages pay off is for a measurement on the hardware to say.

    :param compute_units: the GPU's CU count, which sizes the decode split; None (no device
        visible) keeps the core's default target.
    """
    split = {} if compute_units is None else {
        "decode_split_target": DECODE_PROGRAMS_PER_CU * compute_units
    }
    return TritonAttentionConfig(
        prefill_tile_n=64, decode_tile_n=64, num_warps=4, num_stages=1, **split
    )


class RocmPlatform(Platform):
    """AMD GPUs. Creating one touches no device; :meth:`availability` probes lazily."""

    name = "rocm"
    device_type = "cuda"  # ROCm torch reuses the cuda device type
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    distributed_backend = "nccl"  # torch's name for RCCL on ROCm builds
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
        if torch.version.hip is None:
            if torch.version.cuda is not None:
                return Availability.no(
                    "this is a CUDA build of torch; use the cuda platform"
                )
            return Availability.no(
                f"torch {torch.__version__} was built without ROCm "
                "(torch.version.hip is None); install a ROCm build of torch"
            )
        count, driver_error = _probe_device_count()
        if driver_error is not None:
            return Availability.no(f"driver error: {driver_error}")
        if count == 0:
            return Availability.no(f"no AMD GPU found{_visible_note()}")
        if not _triton_installed():
            return Availability.no(
                "triton is not installed; the rocm platform's attention kernels are written "
                "in Triton (ROCm builds of torch ship it as pytorch-triton-rocm)"
            )
        return Availability.yes()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def graph_capture(self, device_index: int = 0) -> GraphCapture:
        """HIP graphs (torch's CUDA graph API on ROCm) of the decode forward, one memory
        pool per worker (imported here, so listing the platform stays cheap). Untested on
        a GPU so far."""
        from quire.kernels.torch_graphs import TorchGraphCapture

        return TorchGraphCapture(device_index)

    def make_ops(self) -> OpSet:
        """The reference ops with the core's Triton kernels (portable, imported on
        their first call): RMSNorm with the residual add, the gated activations and
        ``fused_moe``."""
        return reference_ops().with_ops("triton", **triton_ops())

    def make_attention_backend(self) -> TritonAttentionBackend:
        """The core's Triton backend with AMD launch parameters, sized to the GPU's CUs.

        With no device visible (the kernels then run on host tensors in Triton's
        interpreter, as the conformance suite's kernels-only mode does) the AMD launch
        parameters stand with the core's default split target.
        """
        compute_units = None
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            compute_units = torch.cuda.get_device_properties(index).multi_processor_count
        return TritonAttentionBackend(attention_config(compute_units))

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """RCCL collectives and send/recv, under torch's backend name "nccl"."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> RocmMemoryProfiler:
        return RocmMemoryProfiler(device_index)


def _probe_device_count() -> tuple[int, str | None]:
    """(visible devices, driver error or None), without creating a device context.

    ROCm torch reports a failed driver query as 0 devices plus a "CUDA initialization:
    ..." warning, as CUDA builds do; that text, or an exception's, is the reason.
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
    """Which of ROCm's device-restricting variables are set (all three filter devices)."""
    names = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    set_ = [f"{name}={os.environ[name]!r}" for name in names if name in os.environ]
    return f" ({', '.join(set_)})" if set_ else ""


def _triton_installed() -> bool:
    """Whether triton can be imported; finds it without importing it."""
    return importlib.util.find_spec("triton") is not None
