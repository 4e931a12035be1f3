"""The communicator contract: collectives between the ranks of one model-parallel group.

Model layers that know their shard (column- or row-parallel linears, the vocabulary
embedding) call these. At world size 1 every operation returns its input unchanged, so a
single-device engine pays nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Communicator(ABC):
    """Collectives over one group. Every rank must call each operation in the same order.

    Tensors are on the platform's device. Results are new tensors unless stated; inputs are
    never changed in place (a backend that reduces in place copies first).
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < world_size``."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group (>= 1)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks; every rank receives the same result, same shape."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim``, in rank order.

        All ranks must pass the same shape; the result's ``dim`` is ``world_size`` times
        longer.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Return ``src``'s tensor on every rank (same shape and dtype on all ranks)."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached this call."""
