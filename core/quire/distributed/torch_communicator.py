"""A :class:`~quire.interfaces.communicator.Communicator` over ``torch.distributed``.

Written once for every platform: a plugin passes its ``Platform.distributed_backend``
name and reuses this class instead of copying it. The caller (the worker that launches
ranks) owns the default process group: it calls ``torch.distributed.init_process_group``
with the same backend, rank and world size *before* building a communicator for more
than one rank, and destroys the group at shutdown.

World size 1 is special on purpose: every collective returns its input object itself
(no copy, no ``torch.distributed`` call, no process group needed), so a single-device
engine pays nothing. The result then aliases the input: a caller that wants to change
the result in place must clone it first. ``send`` and ``recv`` have no peer there and
raise ``ValueError``.

Point-to-point goes through ``torch.distributed.send``/``recv`` on the default group,
which every backend Quire's platforms use (gloo, NCCL/RCCL, XCCL, HCCL) implements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from quire.interfaces.communicator import Communicator


class TorchDistributedCommunicator(Communicator):
    """Collectives and send/recv over a ``torch.distributed`` group (the default one
    unless ``group`` is given), for any backend name.

    :param backend: the ``torch.distributed`` backend the group was initialised with
        (``"gloo"`` for host tensors; device plugins pass their own).
    :param rank: this process's rank in the group, ``0 <= rank < world_size``.
    :param world_size: ranks in the group (>= 1).
    :param group: a subgroup from ``torch.distributed.new_group`` (the tensor-parallel
        ranks of one pipeline stage, say), or None for the default group.
    :raises ValueError: when ``rank``/``world_size`` are out of range.
    :raises RuntimeError: when ``world_size > 1`` and the group is not initialised, or
        has another backend, rank or world size.
    """

    def __init__(self, backend: str, rank: int = 0, world_size: int = 1,
                 group: object | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.backend = backend
        self._rank = rank
        self._world_size = world_size
        self._group = group
        if world_size > 1:
            _check_default_group(backend, rank if group is None else dist.get_rank(),
                                 world_size if group is None else dist.get_world_size())
            if group is not None:
                _check_subgroup(group, rank, world_size)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into a new tensor; at world size 1 the input itself."""
        if self._world_size == 1:
            return tensor
        out = tensor.clone()  # dist.all_reduce works in place; the input must survive
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._group)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation along ``dim`` in rank order; at world size 1 the input itself."""
        if self._world_size == 1:
            return tensor
        src = tensor.contiguous()  # collectives need dense memory
        parts = [torch.empty_like(src) for _ in range(self._world_size)]
        dist.all_gather(parts, src, group=self._group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s tensor in a new tensor on every rank; at world size 1 the input itself."""
        if not 0 <= src < self._world_size:
            raise ValueError(f"broadcast src must be in [0, {self._world_size}), got {src}")
        if self._world_size == 1:
            return tensor
        out = tensor.clone(memory_format=torch.contiguous_format)  # received in place
        if self._group is None:
            dist.broadcast(out, src=src)
        else:
            dist.broadcast(out, group=self._group, group_src=src)
        return out

    def barrier(self) -> None:
        """Wait for every rank; returns at once at world size 1."""
        if self._world_size > 1:
            dist.barrier(group=self._group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Blocking send of ``tensor`` (a contiguous copy when it is not) to ``dst``."""
        self._check_peer("send to dst", dst)
        if self._group is None:
            dist.send(tensor.contiguous(), dst=dst)  # backends send dense memory only
        else:
            dist.send(tensor.contiguous(), group=self._group, group_dst=dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Blocking receive from ``src`` into a new tensor shaped like ``like``."""
        self._check_peer("recv from src", src)
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        if self._group is None:
            dist.recv(out, src=src)
        else:
            dist.recv(out, group=self._group, group_src=src)
        return out

    def _check_peer(self, what: str, peer: int) -> None:
        """Refuse a peer that cannot be one, before torch hangs or fails obscurely."""
        here = f"rank {self._rank} of world size {self._world_size}"
        if self._world_size == 1:
            raise ValueError(f"cannot {what} {peer}: {here} has no peer")
        if peer == self._rank:
            raise ValueError(f"cannot {what} {peer}: that is this rank ({here})")
        if not 0 <= peer < self._world_size:
            raise ValueError(
                f"cannot {what} {peer}: it must be in [0, {self._world_size}) ({here})"
            )

    def __repr__(self) -> str:
        return (
            f"TorchDistributedCommunicator(backend={self.backend!r}, rank={self._rank}, "
            f"world_size={self._world_size})"
        )


def _check_subgroup(group: object, rank: int, world_size: int) -> None:
    got = (dist.get_rank(group), dist.get_world_size(group))  # type: ignore[arg-type]
    if got != (rank, world_size):
        raise RuntimeError(f"the subgroup has this process at rank {got[0]} of {got[1]}, "
                           f"not rank {rank} of {world_size}")


def _check_default_group(backend: str, rank: int, world_size: int) -> None:
    """Fail early, naming what differs, rather than hang or crash inside a collective."""
    if not dist.is_available():
        raise RuntimeError(
            f"torch.distributed is not available in this torch build; cannot run "
            f"{world_size} ranks over the '{backend}' backend"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"no default process group: call torch.distributed.init_process_group("
            f"backend='{backend}', rank={rank}, world_size={world_size}, ...) before "
            f"creating a communicator for {world_size} ranks"
        )
    group_backend = str(dist.get_backend())
    # A group may map several device types to backends ("cpu:gloo,xpu:xccl"); any match
    # means our tensors have a backend to travel on.
    names = {part.split(":")[-1].strip() for part in group_backend.split(",")}
    if backend not in names:
        raise RuntimeError(
            f"the default process group uses backend '{group_backend}', but this "
            f"communicator was asked for '{backend}'"
        )
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"the default process group is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but this communicator was asked for rank {rank} "
            f"of {world_size} (backend '{backend}')"
        )
