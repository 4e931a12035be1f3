"""Loading an image-text model's vision side (tower and projector) by our parameter
names: each tensor through its parameter's loader (this rank's shard), a fused q/k/v
parameter counted once its three parts came."""

from __future__ import annotations

import torch
from torch import nn


class VisionWeights:
    """One ``load_weights`` call's vision tensors for ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self._owner = type(model).__name__
        self._params = dict(model.named_parameters())
        self._whole: set[str] = set()
        self._parts: dict[str, set[str]] = {}

    def load(self, name: str, target: str, shard: str | None, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` into our parameter ``target`` (part ``shard``
        of a fused q/k/v one, or None). :raises ValueError: naming it, when ``target``
        is no parameter."""
        param = self._params.get(target)
        if param is None:
            raise self.refusal(name)
        if shard is None:
            param.weight_loader(param, tensor)
            self._whole.add(target)
        else:
            param.weight_loader(param, tensor, shard)
            self._parts.setdefault(target, set()).add(shard)

    def refusal(self, name: str) -> ValueError:
        """The error for checkpoint tensor ``name`` that fits no parameter."""
        return ValueError(f"checkpoint tensor {name!r} has no parameter in {self._owner}")

    @property
    def loaded(self) -> set[str]:
        """The parameters now completely loaded."""
        return self._whole | {t for t, got in self._parts.items() if got == set("qkv")}
