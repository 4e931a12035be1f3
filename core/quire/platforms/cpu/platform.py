"""The built-in cpu platform: host RAM, SDPA attention, packed linears, gloo."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.platform import Availability, Platform
from quire.ops import OpSet, reference_ops
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.dispatch import (
    TimingCache,
    cpu_model_name,
    describe_cache,
    dispatch_linears,
    host_key,
)
from quire.platforms.cpu.fused_decode import install_fused_decode
from quire.platforms.cpu.fused_stack import install_fused_stack
from quire.platforms.cpu.isa import detect, has_bf16_products
from quire.platforms.cpu.kernel_build import is_prebuilt
from quire.platforms.cpu.memory import CpuMemoryProfiler
from quire.platforms.cpu.native import NativeKernels, load_native_kernels
from quire.platforms.cpu.native_norm import install_norm_kernels
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.packed_linear import onednn_available, pack_linear_weights
from quire.platforms.cpu.quant_linear import (
    BF16_MIN_ROWS,
    BF16_MIN_ROWS_LONG,
    LONG_ROW_COLS,
    make_quantized_linear,
)
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.platforms.cpu.threads import (
    WAIT_ENV,
    StepThreads,
    configure_threads,
    host_wait_policy,
    passive_waiting,
    wait_environment,
)

logger = logging.getLogger(__name__)


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
    encoding. Options: :class:`~quire.platforms.cpu.options.CpuOptions`
    (``platform_options``; ``QUIRE_CPU_*`` variables may set their defaults).
    """

    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"
    # float32 first: the only dtype every CPU computes natively; the half types are for
    # fitting larger models in RAM, at some speed cost on hosts without native support.
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    default_block_size = 16
    priority = 0
    #: every method: weight-only products on the blocks (float activations), and w8a8's
    #: integer products (:mod:`~quire.platforms.cpu.quant_linear`)
    quantizations = ("none", "gguf", "int8", "w8a8", "fp8")

    #: Per-step thread switching, set by configure_process; None before the engine
    #: starts, or when the user set the thread count (then every step uses it).
    _step_threads: StepThreads | None = None
    #: The C kernels (:mod:`~quire.platforms.cpu.native`), built when the model is
    #: prepared or the first backend is made; None when they could not be (the reason
    #: is logged).
    _native: NativeKernels | None = None
    _native_tried = False
    #: Set by :meth:`configure`; read through :attr:`options`.
    _options: CpuOptions | None = None

    def availability(self) -> Availability:
        return Availability.yes()

    def configure(self, options: Mapping[str, Any]) -> None:
        """:raises ValueError: naming an unknown option or a bad value."""
        self._options = CpuOptions.parse(options, os.environ)

    @property
    def options(self) -> CpuOptions:
        """The options :meth:`configure` set; without it, the defaults (and variables)."""
        if self._options is None:
            self._options = CpuOptions.parse({}, os.environ)
        return self._options

    def auto_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """bfloat16 for a bfloat16 checkpoint on a CPU with bfloat16 products (and
        oneDNN to run them), as vLLM does; float32 otherwise (every CPU computes it
        natively), a checkpoint that states no dtype (a GGUF file) included. The choice
        and why are logged.

        A GGUF file keeps a float32 model even where bfloat16 would be faster: a
        bfloat16 residual stream moves the next-token distribution far further from
        float32 than bfloat16 products alone do, enough to change a greedy answer.
        Its products take bfloat16 where that is fast through the ``activations``
        option instead (figures: docs/quantization.md, "Activations").
        """
        features = detect()
        bf16 = (checkpoint_dtype == torch.bfloat16 and has_bf16_products(features)
                and onednn_available())
        chosen = torch.bfloat16 if bf16 else torch.float32
        logger.info("cpu platform: dtype auto -> %s (checkpoint %s; %s)",
                    str(chosen).removeprefix("torch."),
                    str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype
                    else "dtype unstated",
                    "the CPU has bfloat16 products" if has_bf16_products(features)
                    else "no bfloat16 products on this CPU")
        return chosen

    def child_environment(self, options: Mapping[str, Any],
                          env: Mapping[str, str]) -> dict[str, str]:
        """``OMP_WAIT_POLICY=PASSIVE`` when the ``wait_policy`` option says so (``auto``:
        when other processes load the host now), unless the user set it
        (:func:`~quire.platforms.cpu.threads.wait_environment`).

        :raises ValueError: naming a bad option.
        """
        return wait_environment(CpuOptions.parse(options, env).wait_policy, env)

    def configure_process(self) -> None:
        chosen = configure_threads(self.options.threads)
        user_set = chosen is None or self.options.threads is not None
        switch = not user_set and chosen >= 2 and passive_waiting(os.environ)
        self._step_threads = StepThreads(chosen) if switch else None
        if passive_waiting(os.environ):
            return  # waiting as passive waiting would have it: nothing to hint
        if self.options.wait_policy == "auto" and not os.environ.get(WAIT_ENV):
            # the host's load is sampled for a fraction of a second: beside the loading
            # that follows, not before it
            threading.Thread(target=self._hint_passive_waiting, name="quire-wait-hint",
                             daemon=True).start()
        else:
            self._hint_passive_waiting()

    def _hint_passive_waiting(self) -> None:
        """Where OpenMP threads should wait passively but were loaded spinning: torch
        (so OpenMP) was loaded before the engine (an in-process engine: LLM(...), quire
        generate), too late to change, and nothing is wrong; so a hint the user can act
        on, and the why in the debug log."""
        wanted = host_wait_policy(self.options.wait_policy, os.environ)
        if wanted.policy == "passive":
            logger.info("cpu platform: steps may be faster with %s=PASSIVE set before "
                        "the command starts (see the debug log)", WAIT_ENV)
            logger.debug("cpu platform: OpenMP threads should wait passively here (%s), "
                         "but OpenMP was loaded spinning before the engine started",
                         wanted.reason)

    def details(self) -> list[str]:
        """The C kernels this host runs (loaded, as an engine start would), how the
        OpenMP threads of engine processes would wait, what attends, and what ``auto``
        picks for the dtype and for the products' activations."""
        native = self._native_kernels()
        if native is None:
            kernels = "C kernels: none, torch ops (the log says why)"
        else:
            origin = "prebuilt" if is_prebuilt(native.path) else "built here"
            kernels = f"C kernels: ISA level {native.level}, {origin}: {native.path}"
        waiting = host_wait_policy(self.options.wait_policy, os.environ)
        lines = [kernels, f"OpenMP waiting in engine processes: {waiting.policy} "
                          f"({waiting.reason})"]
        if self.options.attention == "reference":
            lines.append("attention: the reference backend (the attention option)")
        elif native is None:
            lines.append("attention: torch SDPA for every step")
        else:
            lines.append("attention: C for decode rows, whole prompts and chunks after a "
                         "cached prefix (pages read in place); torch SDPA for soft-capped "
                         "layers")
        features = detect()
        lines.append("dtype auto: bfloat16 for bfloat16 checkpoints, float32 otherwise"
                     if has_bf16_products(features) and onednn_available() else
                     "dtype auto: float32 (no bfloat16 products on this CPU)")
        lines.append("activations auto (quantised weights, dtype auto): bfloat16 for "
                     f"batches of more than {BF16_MIN_ROWS} rows ({BF16_MIN_ROWS_LONG} on "
                     f"rows of {LONG_ROW_COLS} or more) on the bfloat16 kernel; fewer rows "
                     "on the direct path, rounded to bfloat16 on Q4_0-Q5_1 and Q4_K-Q6_K "
                     "(decode_activations auto), float32 on the other formats"
                     if native is not None and native.has_quant_bf16 else
                     "activations auto (quantised weights): the model's dtype (no "
                     "bfloat16 kernel here)")
        if native is not None and self.options.linear == "packed":
            lines += describe_cache(TimingCache(_timing_cache_path(native)), features,
                                    native.has_panel_gemm, onednn_available())
        return lines

    def begin_step(self, num_tokens: int) -> None:
        if self._step_threads is not None:
            self._step_threads.begin_step(num_tokens)

    def prepare_model(self, model: nn.Module, *, compiled: bool = False) -> None:
        """Pack float32 linear weights (unless the ``linear`` option is ``torch``) and,
        with the native kernels, run float32 RMSNorms and whole decoder layers in C;
        none of it when the model is to be compiled (Inductor cannot lower oneDNN's
        packed weights or a ``ctypes`` call).
        """
        options = self.options
        if compiled:  # Inductor traces neither oneDNN's packed weights nor ctypes calls
            return
        native = self._native_kernels()
        if options.linear == "packed":
            pack_linear_weights(model, native, compact=options.compact)
        if native is not None:
            install_norm_kernels(model, native)
            if options.linear == "packed" and native.has_bf16_gemm:
                # bfloat16 products on pair panels or oneDNN, fused layers' too: chosen
                # before the fused layers take their products' kernels
                dispatch_linears(model, TimingCache(_timing_cache_path(native)),
                                 bfloat16=True)
            # needs the packed layers' panels or copies
            install_fused_decode(model, native, int8_decode=options.int8_decode,
                                 int8_rows=options.activations == "int8",
                                 bf16_decode=options.bf16_decode)
            install_fused_stack(model, native)  # after the layers it strings together
            if options.linear == "packed":  # the products no fused layer claims
                dispatch_linears(model, TimingCache(_timing_cache_path(native)))

    def make_ops(self) -> OpSet:
        """The reference ops, with ``quantized_linear`` on the C kernels when they are
        loaded (:mod:`~quire.platforms.cpu.quant_linear`)."""
        native = self._native_kernels()
        if native is None or not native.has_quant_gemm:
            return reference_ops()
        return reference_ops().with_ops(
            "cpu", quantized_linear=make_quantized_linear(
                native, self.options.int8_decode, int8_all=self.options.activations == "int8",
                bf16_decode=self.options.bf16_decode))

    def bf16_activations(self, dtype_auto: bool) -> bool:
        """The ``activations`` option resolved for this CPU, build and dtype:
        ``bfloat16``, or ``auto`` where the build has the bfloat16 kernel (AVX512_BF16,
        with or without AMX tiles) and the user left ``dtype`` to ``auto`` (an explicit
        ``float32`` keeps float32 products). Logged when it is taken, and when
        ``bfloat16`` cannot run here."""
        chosen = self._resolved_activations(dtype_auto)
        if chosen == "bfloat16" and not self._has_bf16_kernel():
            logger.warning("cpu platform: activations=bfloat16 needs bfloat16 products "
                           "(AVX512_BF16), which this build has not: products stay float32")
            return False
        if chosen == "bfloat16":
            logger.info("cpu platform: batched products on quantised weights take bfloat16 "
                        "activations, the rest of the model its dtype; activations=dtype "
                        "keeps them exact (docs/quantization.md, 'Activations')")
        return chosen == "bfloat16"

    def settle_options(self, options: Mapping[str, Any], *,
                       dtype_auto: bool) -> dict[str, Any]:
        """``activations=auto`` made ``bfloat16`` or ``dtype`` as this host and the
        user's dtype decide (:meth:`bf16_activations`)."""
        settled = dict(options)
        if self.options.activations == "auto":
            settled["activations"] = self._resolved_activations(dtype_auto)
        return settled

    def _has_bf16_kernel(self) -> bool:
        native = self._native_kernels()
        return native is not None and native.has_quant_bf16

    def _resolved_activations(self, dtype_auto: bool) -> str:
        """The ``activations`` option with ``auto`` resolved: ``bfloat16`` for a dtype
        left to auto where the build has the bfloat16 kernel, else ``dtype``. Batches
        of a few rows take the direct path either way
        (:func:`~quire.platforms.cpu.quant_linear.bf16_min_rows`), whose activations
        ``decode_activations`` decides (``auto``: as this resolves; docs/quantization.md,
        'Activations' and 'Decode rows')."""
        chosen = self.options.activations
        if chosen != "auto":
            return chosen
        return "bfloat16" if dtype_auto and self._has_bf16_kernel() else "dtype"

    def make_attention_backend(self) -> ReferenceAttentionBackend:
        """The SDPA backend, or the reference when the ``attention`` option says so."""
        if self.options.attention == "reference":
            return ReferenceAttentionBackend()
        return CpuSdpaAttentionBackend(native=self._native_kernels(),
                                       prefault=self.options.kv_prefault)

    def _native_kernels(self) -> NativeKernels | None:
        if not self._native_tried:
            self._native = load_native_kernels(enabled=self.options.native,
                                               isa=self.options.isa)
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


def _timing_cache_path(native: NativeKernels) -> Path:
    """``<quire cache>/dispatch/<host>.json``: this host's measured timings."""
    from quire.model_store import cache_dir

    key = host_key(detect(), native.level, torch.get_num_threads(), cpu_model_name())
    return cache_dir() / "dispatch" / f"{key}.json"
