"""The built-in cpu platform: host RAM, SDPA attention, packed linears, gloo."""

from __future__ import annotations

import os

import torch
from torch import nn

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform
from quire.platforms.cpu.attention import CpuAttentionBackend
from quire.platforms.cpu.memory import CpuMemoryProfiler
from quire.platforms.cpu.packed_linear import pack_linear_weights
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.platforms.cpu.threads import THREADS_ENV, StepThreads, configure_threads

#: Environment variable naming the attention backend: ``sdpa`` (default) or ``reference``.
ATTENTION_ENV = "QUIRE_CPU_ATTENTION"
#: Environment variable naming the float32 matmul: ``packed`` (default: weights packed
#: for oneDNN and MKL) or ``torch`` (plain ``F.linear``, the matmul Hugging Face runs).
LINEAR_ENV = "QUIRE_CPU_LINEAR"
_BACKENDS: dict[str, type[CpuAttentionBackend]] = {
    "sdpa": CpuSdpaAttentionBackend,
    "reference": CpuAttentionBackend,
}


class CpuPlatform(Platform):
    """Runs anywhere torch runs; the fallback for ``device="auto"`` (priority 0).

    At engine start it sets torch's thread count to the cores the process may use, and
    runs single-token steps on one thread (:mod:`~quire.platforms.cpu.threads`); once
    the model is loaded, its float32 linears
    move to weights packed for oneDNN and MKL (:mod:`~quire.platforms.cpu.packed_linear`).
    Tuning knobs, all environment variables: ``QUIRE_CPU_THREADS``, ``QUIRE_CPU_ATTENTION``
    (``sdpa`` | ``reference``), ``QUIRE_CPU_LINEAR`` (``packed`` | ``torch``).
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

    def availability(self) -> Availability:
        return Availability.yes()

    def configure_process(self) -> None:
        chosen = configure_threads()
        user_set = chosen is None or THREADS_ENV in os.environ
        self._step_threads = None if user_set or chosen < 2 else StepThreads(chosen)

    def begin_step(self, num_tokens: int) -> None:
        if self._step_threads is not None:
            self._step_threads.begin_step(num_tokens)

    def prepare_model(self, model: nn.Module, *, compiled: bool = False) -> None:
        """Pack float32 linear weights unless ``QUIRE_CPU_LINEAR=torch`` or the model is
        to be compiled (Inductor cannot lower oneDNN's packed weights).

        :raises ValueError: naming the accepted values of ``QUIRE_CPU_LINEAR``.
        """
        choice = _env_choice(LINEAR_ENV, "packed", ("packed", "torch"))
        if choice == "packed" and not compiled:
            pack_linear_weights(model)

    def make_attention_backend(self) -> CpuAttentionBackend:
        """The SDPA backend, or the reference when ``QUIRE_CPU_ATTENTION=reference``.

        :raises ValueError: naming the accepted values of ``QUIRE_CPU_ATTENTION``.
        """
        return _BACKENDS[_env_choice(ATTENTION_ENV, "sdpa", tuple(_BACKENDS))]()

    def make_communicator(
        self, rank: int = 0, world_size: int = 1
    ) -> TorchDistributedCommunicator:
        """Collectives over gloo; for ``world_size > 1`` the caller initialised the group."""
        return TorchDistributedCommunicator(self.distributed_backend, rank, world_size)

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
