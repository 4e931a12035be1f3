"""The communicator contract: collectives and point-to-point transfers between the ranks
of one model-parallel group.

Model layers that know their shard (column- or row-parallel linears, the vocabulary
embedding) call the collectives; pipeline stages hand their activations to the next stage
with :meth:`Communicator.send` and :meth:`Communicator.recv`. At world size 1 every
collective returns its input unchanged, so a single-device engine pays nothing; there is
no peer to send to, so send and recv refuse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

#: The plugin API version that added :meth:`Communicator.send` and :meth:`Communicator.recv`.
POINT_TO_POINT_API = "1.1"


class Communicator(ABC):
    """Collectives and point-to-point transfers over one group.

    Every rank must call each collective in the same order; a send and its recv are called
    by their two ranks only. Tensors are on the platform's device. Results are new tensors
    unless stated; inputs are never changed in place (a backend that reduces in place
    copies first).
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

    # -- point to point (plugin API 1.1)
    #
    # Not abstract on purpose: a MINOR version only adds, so a communicator written for
    # plugin API 1.0 must still construct and run its collectives. It inherits these
    # defaults, which raise NotImplementedError; only pipeline parallelism needs them.

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` (any shape, dtype and layout, on the platform's device) to rank
        ``dst``, which must call :meth:`recv` with ``src`` equal to this rank and a tensor
        of the same shape and dtype. Between one pair of ranks, sends and receives match
        in call order. Only the two ranks take part.

        Blocking: returns when the caller may change or free ``tensor`` (on a device with
        streams, through work queued after this call); ``dst`` need not have it yet. A
        backend may also wait until ``dst`` posts its recv, so two ranks must never both
        send to each other first: in a ring, even ranks send first and odd ranks receive
        first. ``tensor`` is not changed. A mismatched pair (shape, dtype, or a missing
        recv) cannot be detected here: it hangs until the process group's timeout or fails
        inside the backend.

        :raises ValueError: at world size 1 (there is no peer), or when ``dst`` is this
            rank or outside ``[0, world_size)``; the message names rank and world size.
        :raises NotImplementedError: this default, for a communicator written for plugin
            API 1.0, before :data:`POINT_TO_POINT_API`.
        """
        raise NotImplementedError(_not_implemented(self, "send"))

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Receive the tensor rank ``src`` sends to this rank with :meth:`send`.

        ``like`` gives only the shape, dtype and device of what arrives (as for
        ``torch.empty_like``, and as the non-source ranks' tensor does for
        :meth:`broadcast`); its values are ignored and it is never written. A tensor
        rather than ``(shape, dtype)`` because a communicator owns no device: the caller
        knows where its activations live, and one argument carries all three.

        Blocking: returns once the data has arrived (on a device with streams, for work
        queued after this call). The result is a new contiguous tensor shaped like
        ``like``. Only the two ranks take part; see :meth:`send` for matching and order.

        :raises ValueError: at world size 1 (there is no peer), or when ``src`` is this
            rank or outside ``[0, world_size)``; the message names rank and world size.
        :raises NotImplementedError: this default, for a communicator written for plugin
            API 1.0, before :data:`POINT_TO_POINT_API`.
        """
        raise NotImplementedError(_not_implemented(self, "recv"))


def _not_implemented(comm: Communicator, operation: str) -> str:
    return (
        f"{type(comm).__name__} does not implement {operation}(): point-to-point "
        f"transfers came with plugin API {POINT_TO_POINT_API}, and pipeline parallelism "
        f"needs them; use a platform plugin built for plugin API {POINT_TO_POINT_API} "
        f"or later"
    )
