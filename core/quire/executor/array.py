"""Host tensors as msgspec structs (dtype, shape, raw bytes): how tensors cross a process
boundary without pickle."""

from __future__ import annotations

import msgspec
import numpy as np
import torch


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A host tensor as bytes: ``dtype`` is a numpy dtype name."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Array:
        host = tensor.detach().to("cpu").contiguous().numpy()
        return cls(str(host.dtype), list(host.shape), host.tobytes())

    def tensor(self) -> torch.Tensor:
        array = np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)
        return torch.from_numpy(array.copy())
