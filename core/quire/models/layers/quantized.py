"""Linear layers and vocabularies whose weight is kept quantised (:mod:`quire.quantization`).

Before the weights load, :func:`prepare_quantized` gives each layer the method quantises a
:class:`LayerQuant` and takes its float weight away (a ``meta`` parameter of the same
shape, which holds no memory and fails loudly if read), so no float copy of it is ever
made. The layer's own weight loader then hands each arriving part (a
:class:`~quire.quantization.tensor.QuantizedTensor` from a GGUF file, or a float tensor
that the method quantises) to :meth:`LayerQuant.store_rows` or
:meth:`LayerQuant.store_cols` with the same rank slicing as a float weight: this rank's
rows (or columns) of the part, a view of the file's blocks where it can be.
:func:`install_quantized_kernels` then gives each layer a
:class:`~quire.ops.quantized.QuantizedLinearKernel` over its parts, on the platform's
``quantized_linear`` op. Fused layers (q/k/v, gate/up)
keep their parts apart: a Q4_K_M file stores q and k in Q4_K and v in Q6_K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quire.ops.quantized import HADAMARD_GROUP, QuantizedLinearKernel
from quire.quantization.formats import FORMATS
from quire.quantization.hadamard import rotate_groups
from quire.quantization.methods import Quantization
from quire.quantization.quantize import quantize_groups, quantize_rows
from quire.quantization.tensor import QuantizedTensor

#: Weights per scale of ``int8``'s groups (a Q8_0 block).
_GROUP = FORMATS["q8_0"].block


@dataclass
class LayerQuant:
    """A quantised layer's method and the parts of its weight loaded so far."""

    quantization: Quantization
    #: where the parts go (the layer's device)
    device: torch.device
    #: ``[out, in]`` of this rank's whole weight
    shape: tuple[int, int]
    #: this rank's parts by their first output row
    parts: dict[int, QuantizedTensor] = field(default_factory=dict)
    #: whether the parts hold ``W H`` for ``w8a8`` (groups of 32 in the Hadamard basis,
    #: :mod:`quire.quantization.hadamard`), so the products take ``H x``; None until the
    #: first part is stored
    rotated: bool | None = None

    def store_rows(self, offset: int, loaded: Any, start: int, size: int) -> None:
        """Rows ``start .. start + size`` of ``loaded`` (a whole checkpoint tensor) are
        this rank's output rows ``offset ..``."""
        if isinstance(loaded, QuantizedTensor):
            part = loaded.narrow_rows(start, size)
            self._note_rotation(False)
        else:
            part = self._quantize(loaded.narrow(0, start, size))
        self._check_width(part)
        self.parts[offset] = part.to(self.device)

    def store_cols(self, loaded: Any, start: int, size: int) -> None:
        """Columns ``start .. start + size`` of ``loaded`` are this rank's whole weight
        (a row-parallel layer's input shard)."""
        if not isinstance(loaded, QuantizedTensor):
            # the whole rows first: a row's scale is then the one a single rank takes
            loaded = self._quantize(loaded, whole_groups=not (start % _GROUP or size % _GROUP))
        else:
            self._note_rotation(False)
        part = loaded.narrow_cols(start, size)
        self._check_width(part)
        self.parts[0] = part.to(self.device)

    def ordered_parts(self) -> list[QuantizedTensor]:
        """The parts in output order.

        :raises ValueError: when they leave a gap or overlap (a part never loaded).
        """
        at, parts = 0, []
        for offset in sorted(self.parts):
            if offset != at:
                raise ValueError(f"quantised weight rows {at}:{offset} were never loaded")
            parts.append(self.parts[offset])
            at += self.parts[offset].rows
        return parts

    def _note_rotation(self, rotated: bool) -> None:
        """Record whether a stored part is in the Hadamard basis; every part of a layer
        must agree, since its products turn their rows once for all of them.

        :raises ValueError: when a part disagrees with the ones stored before.
        """
        if self.rotated is None:
            self.rotated = rotated
        elif self.rotated != rotated:
            raise ValueError("a layer's quantised parts must all be in the Hadamard basis "
                             "or none (w8a8 from float weights, not a GGUF file's blocks)")

    def _quantize(self, weight: torch.Tensor, whole_groups: bool = True) -> QuantizedTensor:
        """``weight`` in the method's on-load format. ``int8``'s 32-weight groups take a
        scale per row instead where the width, or this rank's share of the columns
        (``whole_groups`` False), is not a whole number of groups. ``w8a8`` quantises
        ``W H`` (:mod:`quire.quantization.hadamard`) where the groups of 32 are whole,
        unless ``quantization_config.hadamard`` is off."""
        fmt = self.quantization.on_load_format
        rotate = (self.quantization.rotates and whole_groups
                  and weight.shape[1] % HADAMARD_GROUP == 0)
        self._note_rotation(rotate)
        if rotate:
            weight = rotate_groups(weight.detach().float(), HADAMARD_GROUP)
        if fmt == "q8_0" and whole_groups and weight.shape[1] % _GROUP == 0:
            return quantize_groups(weight)
        if fmt == "q8_0":
            return quantize_rows(weight, "int8")
        if fmt is not None:
            return quantize_rows(weight, fmt)
        # a float tensor where the file is quantised elsewhere: kept as float32 rows
        rows = weight.detach().float().contiguous()
        return QuantizedTensor(FORMATS["f32"], rows.view(torch.uint8), rows.shape[1])

    def _check_width(self, part: QuantizedTensor) -> None:
        if part.cols != self.shape[1]:
            raise ValueError(f"shape mismatch: expected {self.shape[1]} input features, "
                             f"got {part.cols}")


def quantized_sites(model: nn.Module, quantization: Quantization) -> list[nn.Module]:
    """The layers ``quantization`` keeps quantised: every linear site and vocabulary for
    ``gguf`` (each is what the file holds); the linear layers but the LM head for the
    methods that quantise on load."""
    from quire.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    if not quantization.enabled:
        return []
    sites = []
    for module in model.modules():
        if isinstance(module, (ParallelLMHead, VocabParallelEmbedding)):
            if quantization.method == "gguf" and getattr(module, "tied_to", None) is None:
                sites.append(module)
        elif getattr(module, "op_site", None) == "linear":
            sites.append(module)
    return sites


def prepare_quantized(model: nn.Module, quantization: Quantization,
                      device: torch.device | str) -> int:
    """Mark the layers ``quantization`` keeps quantised, their float weights taken away
    (before the model moves to its device, so nothing is allocated for them).

    :returns: how many layers were marked.
    """
    sites = quantized_sites(model, quantization)
    for module in sites:
        old = module.weight
        meta = nn.Parameter(torch.empty(old.shape, device="meta"), requires_grad=False)
        meta.weight_loader = old.weight_loader
        module.weight = meta
        module.quant = LayerQuant(quantization, torch.device(device), tuple(old.shape))
    for module in model.modules():  # a tied LM head shares the (now meta) embedding
        tied = getattr(module, "tied_to", None)
        if tied is not None and getattr(tied, "quant", None) is not None:
            module.weight = tied.weight
    return len(sites)


def install_quantized_kernels(model: nn.Module, ops: Any) -> int:
    """Give every quantised layer its kernel on ``ops.quantized_linear``.

    :returns: how many layers got one.
    :raises ValueError: naming a layer whose parts were not all loaded.
    """
    installed = 0
    for name, module in model.named_modules():
        owner = getattr(module, "tied_to", None) or module
        quant = getattr(owner, "quant", None)
        if quant is None or getattr(module, "op_site", None) != "linear":
            continue
        try:
            parts = quant.ordered_parts()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        module.kernel = QuantizedLinearKernel(parts, ops.quantized_linear, quant.shape[0],
                                              quant.quantization.int8_activations,
                                              rotated=bool(quant.rotated))
        installed += 1
    return installed


def use_bfloat16_activations(model: nn.Module) -> int:
    """Set ``bf16_activations`` on every weight-only quantised layer's kernel (what
    ``Platform.bf16_activations`` asks for; its op takes the keyword).

    :returns: how many layers take it.
    """
    count = 0
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, QuantizedLinearKernel) and not kernel.int8_activations:
            kernel.bf16_activations = True
            count += 1
    return count


def quantized_formats(model: nn.Module) -> dict[str, int]:
    """How many layer parts each format holds (for the load log)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, QuantizedLinearKernel):
            for fmt in kernel.formats:
                counts[fmt] = counts.get(fmt, 0) + 1
    return counts
