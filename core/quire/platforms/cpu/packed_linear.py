"""float32 linear layers on weights laid out once, at load, for the two shapes of a step.

torch's ``F.linear`` hands every product to MKL with the weight as stored (``[out,
in]``). Measured on a 2-core AMD EPYC host (the figures behind the choices below):

- *several rows* (a batch of decode rows, a prompt): MKL repacks the weight on every
  call and, up to a few dozen rows, runs on one thread. oneDNN with the weight packed
  once into its blocked layout is 1.3x (1 thread) to 1.8x (2 threads) faster at 64 rows,
  level at 2048. These are the ``torch.ops.mkldnn`` operators Inductor's CPU freezing
  pass uses.
- *one row* (a lone sequence decoding): the product is a matrix-vector one, bound by
  reading the weight. MKL reads a ``[in, out]`` (transposed) copy 1.5x faster than the
  ``[out, in]`` original, and without oneDNN's ~35 us call overhead, which a step of a
  small model pays ~120 times. But MKL runs a matrix-vector product on one thread, so
  one core's share of the memory bandwidth bounds it (~21 GB/s of ~28 here). The
  transposed copy is therefore cut into ``parts`` column blocks (one per thread at
  packing, ``[parts, in, out / parts]``) and multiplied by one ``bmm``, which torch
  spreads over its threads batch by batch: SmolLM2's 121 products of one decode step
  took 34 ms with ``mm`` and ~21 ms split in two (2 threads).

So each layer keeps both forms (:class:`PackedLinear`), and the original is released:
it stays a parameter of the right shape on the ``meta`` device, so an accidental use
fails loudly, unless another module shares it (a tied embedding). The model's float32
weights then take twice their plain size.

With the native kernels (:mod:`~quire.platforms.cpu.native`, built when a C compiler
is at hand) and AVX2, the forms and the routing are different:

- *every product* runs on the weight packed in 16-column panels for a register-blocked
  kernel (``csrc/panel_gemm.c``), and the oneDNN copy is not kept, so the model's
  float32 weights take their plain size once. Measured in place on SmolLM2 (2 cores):
  inside a 64-row decode step 114-155 GFLOP/s against oneDNN's 73-112; a 2048-row
  prompt step (rows packed first, 512 at a time) 3.05 s against 3.58 s on oneDNN,
  alternating the two in one process.
- *one row, compact weights*: when the weight has an exact compact encoding
  (:mod:`~quire.platforms.cpu.compact`: weights dequantised from GGUF's Q4_0/Q4_1/Q8_0,
  or upcast from bf16), a one-row product streams that encoding instead: 0.75 bytes a
  weight instead of 4 for Q4_1. SmolLM2-135M's 121 one-row products of a decode step
  took 13.5 ms this way against ~33 ms on float32.

Hosts without AVX2 and FMA (or without the native kernels) keep the two forms above.

Exactness: oneDNN and MKL sum in other orders than ``F.linear``; results differ by
float32 rounding (about 1e-6 relative), the same order as MKL's own differences between
batch sizes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quire.platforms.cpu.compact import CompactWeight, encode
from quire.platforms.cpu.native import NativeKernels

logger = logging.getLogger(__name__)

#: Rows oneDNN's packed layout is tuned for: a decode batch. Measured: a 64-row layout is
#: ~10% faster than a 1-row one from 64 to 2048 rows.
PACK_FOR_ROWS = 64
#: Largest product that runs on compact weights. The kernel reads each weight row once
#: for all rows of x but rebuilds it per block of 32, so its cost grows with rows while
#: the panel kernel's is flat at first.
COMPACT_MAX_ROWS = 1


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the two operators used here."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear:
    """``F.linear(x, weight, bias)`` for a float32 ``weight`` kept in the layouts above,
    each product going to the fastest one for its number of rows."""

    def __init__(self, weight: torch.Tensor, native: NativeKernels | None = None,
                 compact: bool = True) -> None:
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
            raise ValueError(f"need a 2-D float32 or bfloat16 weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        weight = weight.detach()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.native = native
        #: the weight's dtype, which the inputs share
        self.dtype = weight.dtype
        if weight.dtype == torch.bfloat16:
            # bfloat16 products multiply in bf16 with float32 sums: on our pair-panel
            # kernel where the build has it (AVX512_BF16; dispatch.py may move a shape
            # to oneDNN, as on AMX hosts), else on oneDNN's packed layout, where
            # F.linear's bfloat16 mm took milliseconds per one-row product. The compact
            # copy (the same bf16 values, exactly) serves the fused C layer of a lone
            # sequence, which computes in float32 (fused_decode.py).
            self.split = None
            self.compact = (encode(weight.float()) if native is not None and compact
                            else None)
            self.panels = self.packed = None
            if native is not None and native.has_bf16_gemm:
                self.panels = native.pack_bf16_panels(weight)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
            return
        #: the weight in an exact compact encoding, for one-row products; None when
        #: there are no native kernels or no encoding reproduces the weight.
        self.compact: CompactWeight | None = (
            encode(weight) if native is not None and compact else None)
        #: the weight in column panels for the native panel kernel, which then runs
        #: every other product; None without that kernel.
        self.panels: torch.Tensor | None = None
        #: without panels: oneDNN's packed copy, and for one row (when there is no
        #: compact copy either) a copy cut per thread.
        self.packed: torch.Tensor | None = None
        self.split: torch.Tensor | None = None
        if native is not None and native.has_panel_gemm:
            self.panels = native.pack_panels(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
            if self.compact is None:
                self.split = self._split(weight)

    @property
    def impl(self) -> str:
        """Which implementation runs products of more than one row: ``panels`` (ours)
        or ``onednn`` (:mod:`~quire.platforms.cpu.dispatch` names)."""
        return "onednn" if self.packed is not None else "panels"

    def weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight in its dtype, rebuilt from the panels (the original
        may have been released)."""
        if self.panels is None:
            raise ValueError("the weight is rebuilt from panels; this layer keeps none")
        if self.dtype == torch.bfloat16:
            return NativeKernels.unpack_bf16_panels(self.panels, self.out_features,
                                                    self.in_features)
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def runner(self, impl: str):
        """A callable computing this layer's product (no bias) on ``impl``, for
        measuring it (:mod:`~quire.platforms.cpu.dispatch`); oneDNN's runs on a
        temporary packed copy when the layer keeps panels."""
        if impl == "panels":
            if self.panels is None:
                raise ValueError("this layer keeps no panels")
            native, panels, n = self.native, self.panels, self.out_features
            if self.dtype == torch.bfloat16:
                return lambda x: native.bf16_linear(x, panels, n, None)
            return lambda x: native.panel_linear(x, panels, n, None)
        if impl == "onednn":
            packed = (self.packed if self.packed is not None
                      else torch.ops.mkldnn._reorder_linear_weight(self.weight(),
                                                                   PACK_FOR_ROWS))
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                [], "")
        raise ValueError(f"unknown linear implementation {impl!r}")

    def use_onednn(self, keep_panels: bool = False) -> None:
        """Run products of more than one row on oneDNN's packed layout. One-row
        products stay on the compact copy when there is one, else on the panels when
        ``keep_panels`` (two copies of the weight: what a host where ours is faster for
        one row and oneDNN for batches pays), else on oneDNN too."""
        if self.panels is None or self.packed is not None:
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight().contiguous(),
                                                              PACK_FOR_ROWS)
        # (a bfloat16 layer's one-row products never run on its compact copy here)
        if not keep_panels or (self.compact is not None and self.dtype == torch.float32):
            self.panels = None

    def _split(self, weight: torch.Tensor) -> torch.Tensor:
        # [parts, in, out / parts], the last block zero-padded when parts does not divide
        # out; parts = 1 is the plain transposed copy.
        parts = max(1, min(torch.get_num_threads(), self.out_features // 64))
        width = -(-self.out_features // parts)
        split = weight.new_zeros(parts * width, self.in_features)
        split[: self.out_features] = weight
        return split.view(parts, width, self.in_features).transpose(1, 2).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # the operators take 2-D input
        y = None
        if self.dtype == torch.bfloat16:
            if self.panels is not None and (self.packed is None or rows.shape[0] == 1):
                y = self.native.bf16_linear(rows, self.panels, self.out_features, bias)
                if y is None:  # only for inputs the model never makes
                    raise ValueError(
                        f"cpu packed linear: need bfloat16 host input of width "
                        f"{self.in_features}, got {x.dtype} {tuple(x.shape)} on {x.device}")
            else:
                y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        if self.compact is not None and rows.shape[0] <= COMPACT_MAX_ROWS:
            y = self.native.compact_linear(rows, self.compact, bias)
        if y is None and self.panels is not None and (self.packed is None
                                                      or rows.shape[0] == 1):
            y = self.native.panel_linear(rows, self.panels, self.out_features, bias)
            if y is None:  # only for inputs the model never makes
                raise ValueError(
                    f"cpu packed linear: need float32 host input of width {self.in_features}"
                    f" and a float32 bias, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if y is None and rows.shape[0] == 1 and self.split is not None:
            y = self._split_product(rows, bias)
        if y is None:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def _split_product(self, row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        parts = self.split.shape[0]
        if parts == 1:
            return (torch.mm(row, self.split[0]) if bias is None
                    else torch.addmm(bias, row, self.split[0]))
        y = torch.bmm(row.expand(parts, 1, self.in_features), self.split)
        y = y.view(1, -1)[:, : self.out_features]  # blocks are in column order
        return y if bias is None else y + bias


def pack_linear_weights(model: nn.Module, native: NativeKernels | None = None,
                        compact: bool = True) -> int:
    """Give every float32 or bfloat16 ``linear`` site of ``model`` (``quire.ops.layer_spec``) a
    :class:`PackedLinear` kernel.

    :param native: the C kernels; with them, layers with an exact compact encoding run
        one-row products on it (unless ``compact`` is False), and with the panel kernel
        every other product runs on it.
    :returns: how many layers were packed (0 when there is neither oneDNN nor the
        panel kernel).
    """
    if not onednn_available() and not (native is not None and native.has_panel_gemm):
        logger.info("cpu platform: no oneDNN in this torch build; linears stay on F.linear")
        return 0
    shared = _shared_parameters(model)
    packed = encoded = 0
    for module in model.modules():
        if (getattr(module, "op_site", None) != "linear"
                or module.weight.dtype not in (torch.float32, torch.bfloat16)):
            continue
        if module.weight.dtype == torch.bfloat16 and not onednn_available():
            continue
        if module.weight.device.type != "cpu":
            continue
        module.kernel = PackedLinear(module.weight, native, compact)
        encoded += module.kernel.compact is not None
        if id(module.weight) not in shared:
            _release(module)
        packed += 1
    logger.info("cpu platform: %d linear layers run on packed weights, %d of them with an "
                "exact compact copy for one-row products", packed, encoded)
    return packed


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied embedding and LM head)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def _release(module: nn.Module) -> None:
    # Same shape, no storage: reading it now raises rather than computing garbage.
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, device="meta"), requires_grad=False)
