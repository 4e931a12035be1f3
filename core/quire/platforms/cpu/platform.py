"""The built-in cpu platform: host RAM, SDPA attention, packed linears, gloo."""

from __future__ import annotations

import os

import torch
from torch import nn

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.fused_decode import install_fused_decode
from quire.platforms.cpu.memory import CpuMemoryProfiler
from quire.platforms.cpu.native import NativeKernels, load_native_kernels
from quire.platforms.cpu.native_norm import install_norm_kernels
from quire.platforms.cpu.packed_linear import pack_linear_weights
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.platforms.cpu.threads import (
    THREADS_ENV,
    StepThreads,
    configure_threads,
    passive_waiting,
)

#: Environment variable naming the attention backend: ``sdpa`` (default) or ``reference``.
ATTENTION_ENV = "QUIRE_CPU_ATTENTION"
#: Environment variable naming the float32 matmul: ``packed`` (default: weights packed
#: for oneDNN and MKL) or ``torch`` (plain ``F.linear``, the matmul Hugging Face runs).
LINEAR_ENV = "QUIRE_CPU_LINEAR"
#: ``0`` keeps every weight in float32 only: no compact copies (and so no fused decode
#: layers); for comparing, or for memory's sake when one-row steps do not matter.
COMPACT_ENV = "QUIRE_CPU_COMPACT"
_BACKENDS = ("sdpa", "reference")


class CpuPlatform(Platform):
    """Runs anywhere torch runs; the fallback for ``device="auto"`` (priority 0).

    At engine start it sets torch's thread count to the cores the process may use
    (:mod:`~quire.platforms.cpu.threads`; with ``OMP_WAIT_POLICY=PASSIVE``, single-token
    steps run on one thread); once the model is loaded, its float32 linears move to
    weights packed once (:mod:`~quire.platforms.cpu.packed_linear`): in panels for the
    C panel kernel when a compiler is at hand (:mod:`~quire.platforms.cpu.native`) on
    an AVX2 host, else for oneDNN and MKL. With the C kernels, decode attention,
    RMSNorm and Llama-family decoder layers run in C too
    (:mod:`~quire.platforms.cpu.fused_decode`), and one-row products of weights with an
    exact compact encoding (:mod:`~quire.platforms.cpu.compact`) stream that
    encoding. Tuning knobs, all
    environment variables: ``QUIRE_CPU_THREADS``, ``QUIRE_CPU_ATTENTION`` (``sdpa`` |
    ``reference``), ``QUIRE_CPU_LINEAR`` (``packed`` | ``torch``), ``QUIRE_CPU_COMPACT``
    (``0``: float32 weights only), ``QUIRE_CPU_NATIVE`` (``0`` for torch ops only).
    """

    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"
    # float32 first: the only dtype every CPU computes natively; the half types are for
    # fitting larger models in RAM, at some speed cost on hosts without native support.
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    default_block_size = 16
    priority = 0

    #: Per-step thread switching, set by configure_process; None before the engine
    #: starts, or when the user set the thread count (then every step uses it).
    _step_threads: StepThreads | None = None
    #: The C kernels (:mod:`~quire.platforms.cpu.native`), built when the model is
    #: prepared or the first backend is made; None when they could not be (the reason
    #: is logged).
    _native: NativeKernels | None = None
    _native_tried = False

    def availability(self) -> Availability:
        return Availability.yes()

    def configure_process(self) -> None:
        chosen = configure_threads()
        user_set = chosen is None or THREADS_ENV in os.environ
        switch = not user_set and chosen >= 2 and passive_waiting(os.environ)
        self._step_threads = StepThreads(chosen) if switch else None

    def begin_step(self, num_tokens: int) -> None:
        if self._step_threads is not None:
            self._step_threads.begin_step(num_tokens)

    def prepare_model(self, model: nn.Module, *, compiled: bool = False) -> None:
        """Pack float32 linear weights (unless ``QUIRE_CPU_LINEAR=torch``) and, with the
        native kernels, run float32 RMSNorms in C; neither when the model is to be
        compiled (Inductor cannot lower oneDNN's packed weights or a ``ctypes`` call).

        :raises ValueError: naming the accepted values of ``QUIRE_CPU_LINEAR``.
        """
        choice = _env_choice(LINEAR_ENV, "packed", ("packed", "torch"))
        if compiled:  # Inductor traces neither oneDNN's packed weights nor ctypes calls
            return
        native = self._native_kernels()
        compact = _env_choice(COMPACT_ENV, "1", ("1", "0")) == "1"
        if choice == "packed":
            pack_linear_weights(model, native, compact=compact)
        if native is not None:
            install_norm_kernels(model, native)
            install_fused_decode(model, native)  # needs the packed layers' panels or copies

    def make_attention_backend(self) -> ReferenceAttentionBackend:
        """The SDPA backend, or the reference when ``QUIRE_CPU_ATTENTION=reference``.

        :raises ValueError: naming the accepted values of ``QUIRE_CPU_ATTENTION``.
        """
        choice = _env_choice(ATTENTION_ENV, "sdpa", _BACKENDS)
        if choice == "reference":
            return ReferenceAttentionBackend()
        return CpuSdpaAttentionBackend(native=self._native_kernels())

    def _native_kernels(self) -> NativeKernels | None:
        if not self._native_tried:
            self._native = load_native_kernels()
            self._native_tried = True
        return self._native

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, group: object | None = None
    ) -> TorchDistributedCommunicator:
        """Collectives and send/recv over gloo; for ``world_size > 1`` the caller
        initialised the group."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size,
                                            group)

    def make_memory_profiler(self, device_index: int = 0) -> CpuMemoryProfiler:
        """Host RAM is one pool, so every ``device_index`` (one per local rank) reads it."""
        return CpuMemoryProfiler()


def _env_choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    """``os.environ[name]`` (case-insensitive), ``default`` when unset or empty.

    :raises ValueError: naming the variable and the accepted values.
    """
    choice = os.environ.get(name, "").strip().lower() or default
    if choice not in accepted:
        raise ValueError(f"{name}={choice!r}: expected one of {', '.join(accepted)}")
    return choice
