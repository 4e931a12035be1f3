"""The platform contract: one kind of hardware, and the factories for its backends.

A plugin ships a :class:`Platform` subclass and registers it through the
``quire_platforms`` hook (see :mod:`quire.plugins.hookspecs`). Creating the subclass and
reading its class attributes must be cheap and must not import any vendor library: the
registry instantiates every discovered platform to list it and to ask whether it is
available. Vendor imports belong inside :meth:`Platform.availability` and the factories.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from quire.interfaces.attention import AttentionBackend
from quire.interfaces.communicator import Communicator
from quire.interfaces.memory import MemoryProfiler
from quire.ops import OpSet, reference_ops


@dataclass(frozen=True)
class Availability:
    """Whether a platform can run here, and if not, why. Truthy when available."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available

    @classmethod
    def yes(cls) -> "Availability":
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> "Availability":
        if not reason:
            raise ValueError("an unavailable platform must say why")
        return cls(False, reason)


class GraphCapture(ABC):
    """Records a stretch of device work once and replays it with one launch (CUDA or HIP
    graphs): what :meth:`Platform.graph_capture` returns. One per worker; the graphs it
    captures share one memory pool, so capture the largest first and replay one at a
    time. Created without touching the device."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Run ``fn`` while recording its device work (a recorder may run it once more
        before, to warm up: ``fn`` must give the same result each time).

        ``fn`` reads its inputs from tensors that outlive the graph and must not sync the
        host (no ``.item()``, no data-dependent shapes); its kernels are already compiled
        (the caller ran it eagerly first). Host-side decisions ``fn`` makes (grid sizes,
        which kernels run) are frozen at capture.

        :returns: ``replay``: re-runs the recorded work on the same memory, reading the
            inputs' current contents, and returns the tensor ``fn`` returned at capture
            (the same tensor each time, overwritten by each replay).
        :raises RuntimeError: when the work cannot be recorded (a sync inside ``fn``).
        """


class Platform(ABC):
    """One hardware target. Subclasses set the class attributes and implement the methods."""

    #: Name used by ``--device`` and ``LLM(device=...)``: lower-case, unique among plugins.
    name: ClassVar[str]
    #: ``torch.device`` type the tensors live on ("cpu", "cuda", "xpu", "npu", "hpu").
    device_type: ClassVar[str]
    #: Environment variable that restricts visible devices, or None.
    visible_devices_env: ClassVar[str | None] = None
    #: ``torch.distributed`` backend for the communicator ("gloo", "nccl", ...).
    distributed_backend: ClassVar[str]
    #: dtypes the backends support, the preferred one first (used for ``dtype="auto"``).
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]]
    #: Tokens per KV page when the user does not choose.
    default_block_size: ClassVar[int]
    #: Preference for ``device="auto"`` among available platforms; higher wins. cpu is 0.
    priority: ClassVar[int] = 0
    #: The ``quantization`` methods this platform runs (:mod:`quire.quantization.methods`).
    #: The default is what the op set's reference ``quantized_linear`` runs on any torch
    #: device (weights dequantised a slab at a time, float products); a platform adds
    #: ``w8a8`` when its ``quantized_linear`` takes ``int8_activations`` (integer
    #: products) on ``int8`` rows and on ``q8_0`` blocks (``w8a8``'s default groups: int8
    #: activations per 32 values), and replaces the op with kernels that read the blocks
    #: in place. Plugin
    #: API 1.3; an older plugin gets this default.
    quantizations: ClassVar[tuple[str, ...]] = ("none", "gguf", "int8", "fp8")

    @abstractmethod
    def availability(self) -> Availability:
        """Probe the hardware and its libraries. Never raises: failures become reasons.

        The reason is precise enough to act on ("torch was built without CUDA",
        "no device found", "driver error: ...").
        """

    def is_available(self) -> Availability:
        """Same as :meth:`availability`; a truthy result carrying the reason when falsy."""
        return self.availability()

    def device(self, index: int = 0) -> torch.device:
        """The ``torch.device`` for local device ``index``."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """:raises ValueError: naming the supported dtypes when ``dtype`` is not one."""
        if dtype not in self.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(
                f"dtype {str(dtype).removeprefix('torch.')} is not supported on the "
                f"'{self.name}' platform; choose one of: {names}"
            )

    def auto_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype ``dtype="auto"`` runs a checkpoint at, given the dtype it is stored
        in (None: unknown, e.g. GGUF). By default the first of :attr:`supported_dtypes`;
        a platform whose speed depends on the host may choose per checkpoint (plugin
        API 1.2; must return one of :attr:`supported_dtypes`)."""
        return self.supported_dtypes[0]

    def bf16_activations(self, dtype_auto: bool) -> bool:
        """Whether a model's weight-only quantised products take bfloat16 activations
        (the op set ``quantized_linear``'s ``bf16_activations``: float32 rows and weights
        rounded to bfloat16, float32 sums and results), given whether the user left
        ``dtype`` to ``auto`` (an explicit ``float32`` asks for float32 products). Only
        for a platform whose op takes that keyword. Plugin API 1.5; default False."""
        return False

    def settle_options(self, options: Mapping[str, Any], *,
                       dtype_auto: bool) -> dict[str, Any]:
        """``options`` (its ``platform_options``) with every choice that depends on the
        host or on ``dtype="auto"`` made explicit: what the engine core hands its
        workers, with the dtype it settled, so that ranks on other hosts run as it
        decided. Called after :meth:`configure`. Plugin API 1.5; default: unchanged."""
        return dict(options)

    def synchronize(self) -> None:
        """Wait for queued device work (for timing). Host platforms need nothing."""

    def prepare_model(self, model: nn.Module, *, compiled: bool = False) -> None:
        """Adapt a loaded model to this platform, in place; called once by the engine
        after the weights are loaded and before the KV cache is sized.

        For example, install a ``LinearKernel`` (``quire.models.layers.linear``) on the
        linear layers. Results must stay those of the unprepared model up to float
        rounding. Default: nothing.

        :param compiled: the engine will ``torch.compile`` the model next; leave out any
            change the compiler cannot trace.
        """

    def begin_step(self, num_tokens: int) -> None:
        """Called by the engine before each step's forward, with the step's token count,
        for tuning that depends on the step's size (the cpu platform runs single-token
        steps on one thread). Must not change results. Default: nothing.
        """

    def graph_capture(self, device_index: int = 0) -> GraphCapture | None:
        """A recorder of device graphs for local device ``device_index``, or None: this
        platform runs every step eagerly (the default). With one, the model runner
        captures its decode forward for a ladder of batch sizes after the KV cache is
        allocated and replays it for decode-only steps (``quire.executor.graphs``);
        ``EngineConfig.enforce_eager`` turns it off. Plugin API 1.2.
        """
        return None

    def configure(self, options: Mapping[str, Any]) -> None:
        """Take the user's platform options (``EngineConfig.platform_options``), checked
        into this platform's own typed options; called once, before anything else.

        :raises ValueError: naming an unknown option or a bad value. Default: this
            platform takes no options, so any is unknown.
        """
        if options:
            raise ValueError(f"the '{self.name}' platform takes no options; got "
                             f"{', '.join(sorted(options))}")

    def child_environment(self, options: Mapping[str, Any],
                          env: Mapping[str, str]) -> dict[str, str]:
        """Variables a process that will run this platform's work (an engine core, a
        ``mp`` worker) must have before it imports torch: settings its libraries read
        once, when they load (the cpu platform: OpenMP's ``OMP_WAIT_POLICY``).

        Called in the process that starts the child, which may have loaded torch
        already and need not have called :meth:`configure` on this instance; the child
        inherits ``env`` with the result laid over it. Must not touch the device.
        Plugin API 1.2.

        :param options: the user's ``platform_options``, unchecked, as :meth:`configure`
            gets them.
        :param env: the environment the child would inherit; a variable the user set
            there is theirs (leave it out of the result to keep it).
        :returns: the variables to set; empty, the default, for none.
        :raises ValueError: naming a bad option.
        """
        return {}

    def configure_process(self) -> None:
        """Process-wide tuning, called once by the engine before it builds the model.

        For settings that belong to the process rather than to one backend object (the
        cpu platform sets torch's thread count here). Must respect what the user set
        explicitly. Default: nothing.
        """

    def details(self) -> list[str]:
        """Lines ``quire plugins`` prints for this platform when it is available: what it
        would run on this host (the cpu platform: which kernel library, how threads
        wait). May do what an engine start would (load a library); must not start one.
        Default: none.
        """
        return []

    def make_ops(self) -> OpSet:
        """The ops model code runs on this platform (:mod:`quire.ops`): the reference
        set with the entries this platform implements natively replaced
        (``reference_ops().with_ops("<label>", rms_norm=...)``). Each must meet its
        reference's contract up to float rounding. Default: the reference set.
        """
        return reference_ops()

    @abstractmethod
    def make_attention_backend(self) -> AttentionBackend:
        """A new attention backend for this platform.

        Must work without the device present (falling back to default tuning), so the
        conformance suite's kernels-only mode can run the kernels on host tensors.
        """

    @abstractmethod
    def make_communicator(self, rank: int = 0, world_size: int = 1,
                          group: object | None = None) -> Communicator:
        """A communicator for one model-parallel group over :attr:`distributed_backend`.

        :param rank: this process's rank in the group; :param world_size: its size.
        :param group: a ``torch.distributed`` subgroup (the tensor-parallel ranks of one
            pipeline stage, or the stages of one tensor-parallel rank), or None for the
            default group. Plugin API 1.1; a 1.0 plugin cannot run tensor x pipeline.
        """

    @abstractmethod
    def make_memory_profiler(self, device_index: int = 0) -> MemoryProfiler:
        """A profiler for local device ``device_index``."""


def configure_platform(platform: Platform, config: Any) -> None:
    """``platform.configure(config.platform_options)``, its errors prefixed with the
    option's name so that they say where the bad value came from."""
    try:
        platform.configure(config.platform_options or {})
    except ValueError as exc:
        raise ValueError(f"platform_options: {exc}") from None
