"""A sparse mixture-of-experts block: a router and every expert's SiLU-gated MLP, stacked.

Parameters, named as the models that use it expect (``<prefix>.gate.weight`` is the
router, as in Hugging Face checkpoints):

- ``gate.weight`` [E, H]: the router, whole on every rank.
- ``w13`` [E, 2 * I / world, H]: each expert's gate and up projections, this rank's rows
  of each, laid out ``[gate_r; up_r]`` (as :class:`MergedColumnParallelLinear`).
- ``w2`` [E, H, I / world]: each expert's down projection, this rank's input columns.

Tensor parallelism shards every expert on its intermediate dimension, so each rank runs
every expert on its slice and one ``all_reduce`` sums the partial outputs (the pairing of
a column- and a row-parallel linear). Routing is computed whole on every rank from the
same input, so every rank picks the same experts.

The loaders take a checkpoint's per-expert tensors: ``weight_loader(param, tensor,
(expert, part))`` with part 0 (gate) or 1 (up) for ``w13``, ``(param, tensor, expert)``
for ``w2``; with no shard id, the tensor is every expert stacked (``[E, 2I, H]`` gate
then up, or ``[E, H, I]``), as transformers stores them in memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.compile import never_traced
from quire.models.context import ForwardContext
from quire.models.layers.linear import divide


def _check_shape(what: str, expected: tuple[int, ...], got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"{what}: expected shape {tuple(expected)}, got {tuple(got)}")


class Router(nn.Module):
    """The router's ``[E, H]`` weight, replicated on every rank; the checkpoint's
    ``gate``."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> router logits [T, E]."""
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """``sum over the top_k chosen experts of weight * down(silu(gate(x)) * up(x))``.

    :param num_experts: E. :param top_k: experts per token.
    :param intermediate_size: each expert's full I (before sharding).
    :param renormalize: divide the top_k weights by their sum.
    :raises ValueError: when ``intermediate_size`` does not divide by the world size, or
        ``top_k`` is not in [1, E].
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, *, renormalize: bool, comm: Communicator) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and "
                             f"num_experts={num_experts}")
        self.comm = comm
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_per_rank = divide(intermediate_size, comm.world_size,
                                            "moe intermediate_size")
        i = self.intermediate_per_rank
        self.gate = Router(hidden_size, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size),
                                requires_grad=False)
        self.w13.weight_loader = self.w13_loader
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.w2.weight_loader = self.w2_loader

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[T, H] -> [T, H], summed over ranks."""
        weights, ids = ctx.ops.select_experts(self.gate(x), self.top_k, self.renormalize)
        y = self._experts(x, weights, ids, ctx)
        return self.comm.all_reduce(y) if self.comm.world_size > 1 else y

    # Never traced by torch.compile (quire.models.compile): which experts run, and on how
    # many tokens, changes every step, and would make every step a new graph.
    @never_traced
    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        return ctx.ops.fused_moe(x, self.w13, self.w2, weights, ids)

    def expert_shards(self) -> dict[str, frozenset[Any]]:
        """Every shard id each stacked parameter needs before it counts as loaded."""
        e = range(self.num_experts)
        return {"w13": frozenset((x, p) for x in e for p in (0, 1)), "w2": frozenset(e)}

    def w13_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: Any = None) -> None:
        """This rank's rows of expert ``e``'s gate (part 0) or up (part 1), ``[I, H]``."""
        full_i, h = self.intermediate_size, self.hidden_size
        if shard_id is None:
            _check_shape("w13", (self.num_experts, 2 * full_i, h), loaded.shape)
            for e in range(self.num_experts):
                for part, tensor in enumerate(loaded[e].split(full_i, dim=0)):
                    self.w13_loader(param, tensor, (e, part))
            return
        e, part = self._expert_part(shard_id)
        _check_shape(f"expert {e} {('gate', 'up')[part]}", (full_i, h), loaded.shape)
        n = self.intermediate_per_rank
        param.data[e].narrow(0, part * n, n).copy_(loaded.narrow(0, self.comm.rank * n, n))

    def w2_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                  shard_id: Any = None) -> None:
        """This rank's input columns of expert ``shard_id``'s down projection, ``[H, I]``."""
        full_i, h = self.intermediate_size, self.hidden_size
        if shard_id is None:
            _check_shape("w2", (self.num_experts, h, full_i), loaded.shape)
            for e in range(self.num_experts):
                self.w2_loader(param, loaded[e], e)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < self.num_experts:
            raise ValueError(f"expert id must be below {self.num_experts}, got {shard_id!r}")
        _check_shape(f"expert {shard_id} down", (h, full_i), loaded.shape)
        n = self.intermediate_per_rank
        param.data[shard_id].copy_(loaded.narrow(1, self.comm.rank * n, n))

    def _expert_part(self, shard_id: Any) -> tuple[int, int]:
        ok = (isinstance(shard_id, tuple) and len(shard_id) == 2
              and isinstance(shard_id[0], int) and 0 <= shard_id[0] < self.num_experts
              and shard_id[1] in (0, 1))
        if not ok:
            raise ValueError(f"w13 shard id must be (expert below {self.num_experts}, "
                             f"0 or 1), got {shard_id!r}")
        return shard_id

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_per_rank}/{self.intermediate_size}, "
                f"renormalize={self.renormalize}")
