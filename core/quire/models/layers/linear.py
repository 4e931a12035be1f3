"""Linear layers that hold one tensor-parallel shard of a checkpoint weight.

Megatron-style pairing: a :class:`ColumnParallelLinear` splits the *output* features over
ranks, so each rank computes a slice of the activations with no communication; the
:class:`RowParallelLinear` that follows splits its *input* features the same way and sums
the partial products with one ``all_reduce``. An attention block or an MLP therefore
costs one collective.

Weights are stored as ``[out_features, in_features]`` like ``nn.Linear`` and Hugging Face
checkpoints. Parameters are created with ``torch.empty`` (the checkpoint overwrites them)
and without gradients (this is an inference engine).

Every parameter carries ``weight_loader(param, loaded, shard_id=None)``, which takes the
*full* checkpoint tensor and copies this rank's part into ``param``; fused layers use
``shard_id`` to say which part of the fusion ``loaded`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.quantization.tensor import QuantizedTensor


class LinearKernel(Protocol):
    """A platform's own ``F.linear(x, layer.weight, bias)`` for one loaded layer.

    Installed as ``layer.kernel`` by ``Platform.prepare_model`` once the weights are
    loaded (the cpu platform's holds a oneDNN-packed copy of the weight). It must compute
    the same product as ``F.linear`` up to float rounding. ``None`` (the default) means
    ``F.linear`` on ``layer.weight``.
    """

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[..., in] -> [..., out]``; adds ``bias`` when given."""


def apply_linear(
    kernel: LinearKernel | None, x: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the layer's kernel when it has one."""
    if kernel is None:
        return F.linear(x, weight, bias)
    return kernel(x, bias)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
) -> None:
    """Copy a whole, unsharded tensor into ``param`` (converting its dtype).

    :raises ValueError: on a shard id (nothing to pick) or a shape mismatch.
    """
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
    _check_shape(param.shape, loaded.shape)
    param.data.copy_(_float(loaded))


def _copy_rows(layer: nn.Module, param: nn.Parameter, loaded: Any, offset: int,
               size: int, start: int) -> None:
    """``param`` rows ``offset ..`` = ``loaded`` rows ``start ..`` (``size`` of them); for
    a quantised layer's weight, that part kept quantised instead
    (:class:`~quire.models.layers.quantized.LayerQuant`)."""
    quant = getattr(layer, "quant", None)
    if quant is not None and param is layer.weight:
        quant.store_rows(offset, loaded, start, size)
        return
    param.data.narrow(0, offset, size).copy_(_float(loaded).narrow(0, start, size))


def _float(loaded: Any) -> torch.Tensor:
    """A checkpoint tensor as a float tensor (a quantised one dequantised)."""
    return loaded.dequantize() if isinstance(loaded, QuantizedTensor) else loaded


def divide(total: int, world_size: int, what: str) -> int:
    """``total // world_size``, refusing a remainder (a shard must be whole).

    :raises ValueError: naming ``what`` when ``total`` does not divide.
    """
    if total % world_size:
        raise ValueError(f"{what}={total} is not divisible by the world size {world_size}")
    return total // world_size


def _check_shape(expected: torch.Size | tuple[int, ...], got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"shape mismatch: expected {tuple(expected)}, got {tuple(got)}")


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def whole_param(*shape: int) -> nn.Parameter:
    """An uninitialised parameter every rank loads whole (:func:`default_weight_loader`):
    a norm's weight, an embedding table, a patch convolution."""
    param = _empty_param(*shape)
    param.weight_loader = default_weight_loader
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows split evenly over the ranks.

    Rank ``r`` holds rows ``[r * n, (r + 1) * n)`` with ``n = output_size / world_size``
    and returns only its ``n`` output features, unless ``gather_output`` concatenates
    every rank's slice (an ``all_gather``).

    :raises ValueError: when ``output_size`` does not divide by the world size.
    """

    #: What a platform may run its own way (``quire.ops.layer_spec``): ``F.linear``.
    op_site = "linear"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        comm: Communicator,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, comm.world_size, "output_size")
        self.gather_output = gather_output
        self.kernel: LinearKernel | None = None
        self.weight = _empty_param(self.output_size_per_rank, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias: nn.Parameter | None = _empty_param(self.output_size_per_rank)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., output_size_per_rank] (or output_size if gathered)."""
        y = apply_linear(self.kernel, x, self.weight, self.bias)
        if self.gather_output and self.comm.world_size > 1:
            y = self.comm.all_gather(y, dim=-1)
        return y

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's rows of the full ``[output_size, ...]`` tensor."""
        if shard_id is not None:
            raise ValueError(f"this linear is not fused; got shard id {shard_id!r}")
        n = self.output_size_per_rank
        _check_shape((self.output_size, *param.shape[1:]), loaded.shape)
        _copy_rows(self, param, loaded, 0, n, self.comm.rank * n)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size_per_rank}/{self.output_size}, "
            f"bias={self.bias is not None}"
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears on the same input, as one matmul.

    Used for an MLP's ``gate_proj`` and ``up_proj``: ``output_sizes=[I, I]``. Each part is
    sharded on its own, so rank ``r`` holds ``[gate_r; up_r]`` and can split its output
    in two with no communication. ``shard_id`` is the part's index in ``output_sizes``;
    ``None`` means ``loaded`` is already the full fusion of every part, in order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        comm: Communicator,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            divide(size, comm.world_size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(self.output_sizes), bias=bias, comm=comm)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's rows of part ``shard_id`` into that part's place."""
        if shard_id is None:
            _check_shape((self.output_size, *param.shape[1:]), loaded.shape)
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an index below {len(self.output_sizes)}, got {shard_id!r}"
            )
        ws, rank = self.comm.world_size, self.comm.rank
        size = self.output_sizes[shard_id] // ws
        offset = sum(self.output_sizes[:shard_id]) // ws
        _check_shape((self.output_sizes[shard_id], *param.shape[1:]), loaded.shape)
        _copy_rows(self, param, loaded, offset, size, rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused, sharded by attention head.

    Rank ``r`` holds query heads ``[r * Hq, (r + 1) * Hq)`` and the key/value heads they
    read, laid out ``[q_r; k_r; v_r]``. When there are fewer key/value heads than ranks,
    each key/value head is replicated on ``world_size / total_num_kv_heads`` consecutive
    ranks (query heads are grouped in the same order, so each rank's queries read the
    head it holds).

    ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``; ``None`` means ``loaded`` is the full
    ``[q; k; v]`` fusion.

    :raises ValueError: when the query heads do not divide by the world size, or the
        key/value heads neither divide it nor are divided by it.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool,
        comm: Communicator,
    ) -> None:
        ws = comm.world_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, ws, "num_attention_heads")
        if total_num_kv_heads >= ws:
            self.num_kv_heads = divide(total_num_kv_heads, ws, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _replicas(total_num_kv_heads, ws)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sized as the whole layer over all ranks, replicas included, so the parent's
        # division by the world size gives exactly this rank's q + k + v rows.
        super().__init__(
            hidden_size, (self.q_size + 2 * self.kv_size) * ws, bias=bias, comm=comm
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's heads of ``loaded`` (the full q, k or v tensor)."""
        total_q = self.total_num_heads * self.head_size
        total_kv = self.total_num_kv_heads * self.head_size
        if shard_id is None:
            _check_shape((total_q + 2 * total_kv, *param.shape[1:]), loaded.shape)
            for sid, part in zip("qkv", loaded.split([total_q, total_kv, total_kv], dim=0)):
                self.weight_loader(param, part, sid)
            return
        rank = self.comm.rank
        if shard_id == "q":
            expected, offset, size, start = total_q, 0, self.q_size, rank * self.q_size
        elif shard_id in ("k", "v"):
            expected, size = total_kv, self.kv_size
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            start = (rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        _check_shape((expected, *param.shape[1:]), loaded.shape)
        _copy_rows(self, param, loaded, offset, size, start)


def _replicas(total_num_kv_heads: int, world_size: int) -> int:
    if world_size % total_num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={total_num_kv_heads} is below the world size {world_size} "
            "and does not divide it, so heads cannot be replicated evenly"
        )
    return world_size // total_num_kv_heads


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s input columns split evenly over the ranks.

    The input is the matching column-parallel layer's output slice; each rank's partial
    product is summed with ``comm.all_reduce``. The bias is whole on every rank and is
    added once, after the reduce (adding it before would count it ``world_size`` times).

    :raises ValueError: when ``input_size`` does not divide by the world size.
    """

    #: What a platform may run its own way (``quire.ops.layer_spec``): ``F.linear``.
    op_site = "linear"

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, comm: Communicator
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, comm.world_size, "input_size")
        self.kernel: LinearKernel | None = None
        self.weight = _empty_param(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias: nn.Parameter | None = _empty_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size_per_rank] -> [..., output_size], summed over ranks."""
        if self.comm.world_size == 1:
            # One fused op, so a single device matches a plain nn.Linear bit for bit.
            return apply_linear(self.kernel, x, self.weight, self.bias)
        y = self.comm.all_reduce(apply_linear(self.kernel, x, self.weight, None))
        return y if self.bias is None else y + self.bias

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's input columns of the weight; the bias whole."""
        if shard_id is not None:
            raise ValueError(f"this linear is not fused; got shard id {shard_id!r}")
        if param is self.bias:
            _check_shape(param.shape, loaded.shape)
            param.data.copy_(_float(loaded))
            return
        n = self.input_size_per_rank
        _check_shape((self.output_size, self.input_size), loaded.shape)
        quant = getattr(self, "quant", None)
        if quant is not None:
            quant.store_cols(loaded, self.comm.rank * n, n)
            return
        param.data.copy_(_float(loaded).narrow(1, self.comm.rank * n, n))

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_rank}/{self.input_size}, out={self.output_size}, "
            f"bias={self.bias is not None}"
        )
