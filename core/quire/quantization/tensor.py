""":class:`QuantizedTensor`: a 2-D weight kept in its block format, with its rows and
columns still addressable (a tensor-parallel shard is a view, not a copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quire.heap import populate_write
from quire.quantization.formats import QuantFormat


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[rows, cols]`` weight in ``format``.

    ``data`` is uint8 ``[rows, row_bytes]`` whose rows may lie further apart than
    ``row_bytes`` (``data.stride(0) >= row_bytes``, ``data.stride(1) == 1``): a slice of
    a row-parallel shard's columns is a view. It may be a view of a memory-mapped file.
    ``scale`` is float32 ``[rows]`` for row-scaled formats, else None.
    """

    format: QuantFormat
    data: torch.Tensor
    cols: int
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        fmt = self.format
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{fmt.name}: data must be 2-D uint8, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.data.shape[1] != fmt.row_bytes(self.cols):
            raise ValueError(f"{fmt.name}: {self.cols} columns take "
                             f"{fmt.row_bytes(self.cols)} bytes a row, data has "
                             f"{self.data.shape[1]}")
        if self.data.shape[0] > 1 and self.data.stride(1) != 1:
            raise ValueError(f"{fmt.name}: a row's bytes must be contiguous")
        if fmt.row_scaled != (self.scale is not None):
            raise ValueError(f"{fmt.name}: a scale per row is "
                             f"{'required' if fmt.row_scaled else 'not expected'}")
        if self.scale is not None and (self.scale.dtype != torch.float32
                                       or tuple(self.scale.shape) != (self.rows,)):
            raise ValueError(f"{fmt.name}: scale must be float32 [{self.rows}]")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes (its rows and scales, not any gap between rows)."""
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.rows * self.data.shape[1] + scale

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        """Rows ``start .. start + length``: a view."""
        if start < 0 or length < 0 or start + length > self.rows:
            raise ValueError(f"rows {start}:{start + length} of {self.rows}")
        scale = None if self.scale is None else self.scale.narrow(0, start, length)
        return QuantizedTensor(self.format, self.data.narrow(0, start, length), self.cols,
                               scale)

    def narrow_cols(self, start: int, length: int) -> QuantizedTensor:
        """Columns ``start .. start + length``: a view, when both are whole blocks.

        :raises ValueError: when a bound falls inside a block.
        """
        block = self.format.block
        if start % block or length % block or start < 0 or start + length > self.cols:
            raise ValueError(
                f"{self.format.name} weights split on {block}-weight blocks: columns "
                f"{start}:{start + length} of {self.cols} do not (choose a "
                f"tensor_parallel_size that divides the width into whole blocks)")
        size = self.format.block_bytes
        data = self.data.narrow(1, start // block * size, length // block * size)
        return QuantizedTensor(self.format, data, length, self.scale)

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows ``index`` names, in that order: a copy (of the quantised bytes)."""
        scale = None if self.scale is None else self.scale.index_select(0, index)
        return QuantizedTensor(self.format, self.data.index_select(0, index), self.cols,
                               scale)

    def reorder_rows_(self, index: torch.Tensor) -> QuantizedTensor:
        """Put the rows in the order ``index`` names, where they lie (``index`` a
        permutation of the rows); returns ``self``. In a copy-on-write map of a file this
        holds one copy of the rows: their pages become the process's own and the file's
        pages are let go, where :meth:`select_rows` would hold both."""
        rows, width = self.data.shape
        if rows:  # the map's pages made the process's own in one call, not a fault each
            populate_write(self.data.data_ptr(), (rows - 1) * self.data.stride(0) + width)
        self.data.copy_(self.data.index_select(0, index))
        if self.scale is not None:
            self.scale.copy_(self.scale.index_select(0, index))
        return self

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """On ``device``, rows packed (a copy unless already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        scale = None if self.scale is None else self.scale.to(device)
        return QuantizedTensor(self.format, self.data.contiguous().to(device), self.cols,
                               scale)

    def contiguous(self) -> QuantizedTensor:
        """Rows packed back to back (a copy when they were a strided view)."""
        if self.data.is_contiguous():
            return self
        return QuantizedTensor(self.format, self.data.contiguous(), self.cols, self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``[rows, cols]`` floats (float32 arithmetic, then ``dtype``)."""
        from quire.quantization.dequant import dequantize_rows

        return dequantize_rows(self).to(dtype)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.format.name}, {self.rows}x{self.cols})"
