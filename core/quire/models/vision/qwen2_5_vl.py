"""Qwen2.5-VL's vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``),
on the op set.

==============  ========================================================================
patches         the processor's flattened (channels, temporal patch, patch, patch) cubes,
                one per row, embedded by the Conv3d's weight as one product (the kernel
                equals the stride: each cube is one dot product per channel out)
order           patches come block-major (each ``merge x merge`` block of patches is
                consecutive, as the merger reads them); the tower reorders the blocks by
                window, runs every layer in that order, and restores it after the merger
rotary          2D: the first half of each head's frequencies rotate by the patch's row,
                the second by its column, in float32
attention       within each window (``window_size`` pixels a side) on most layers, over
                each whole image on ``fullatt_block_indexes``: both through
                ``ops.bidirectional_attention`` with one segment per window or image
merger          RMSNorm, then each block's ``merge^2`` patches joined and projected by a
                GELU MLP to the text model's width: one embedding per block
==============  ========================================================================

Linears are tensor-parallel like the decoder's: heads and the MLPs split over the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    apply_rotary,
    default_weight_loader,
)
from quire.ops import OpSet

#: transformers hard-codes the tower's RMSNorm epsilon.
_NORM_EPS = 1e-6

Grid = tuple[int, int, int]


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(.))``, over patches flattened to [N, D]."""

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.norm1 = RMSNorm(hidden, _NORM_EPS)
        self.norm2 = RMSNorm(hidden, _NORM_EPS)
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True,
                                     comm=comm)
        self.num_heads = self.qkv.num_heads  # on this rank
        self.proj = RowParallelLinear(hidden, hidden, bias=True, comm=comm)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [config.intermediate_size] * 2, bias=True, comm=comm)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias=True,
                                           comm=comm)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segments: tuple[torch.Tensor, list[int]], ops: OpSet) -> torch.Tensor:
        """:param rotary: float32 (cos, sin) [N, 1, head_dim] for :func:`apply_rotary`.
        :param segments: (starts [S+1] on the device, lengths) of the attention segments."""
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x, ops=ops)).view(
            n, 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rotary(q.float(), *rotary).to(x.dtype)
        k = apply_rotary(k.float(), *rotary).to(x.dtype)
        attn = ops.bidirectional_attention(q, k, v, *segments, scale=self.scale)
        x = x + self.proj(attn.reshape(n, -1))
        return x + self.down_proj(ops.silu_and_mul(self.gate_up_proj(self.norm2(x, ops=ops))))


class PatchMerger(nn.Module):
    """``mlp(ln_q(x))`` with each ``merge^2`` consecutive patches joined into one row."""

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, _NORM_EPS)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.width, self.width, bias=True, comm=comm),
            nn.GELU(),
            RowParallelLinear(self.width, config.out_hidden_size, bias=True, comm=comm))

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return self.mlp(self.ln_q(x, ops=ops).view(-1, self.width))


class Qwen25VisionTower(nn.Module):
    """Patches [N, C * tp * p * p] of images with grids (t, h, w) in patches -> one
    embedding per ``merge x merge`` block, [N / merge^2, out_hidden_size], images in order.

    :raises ValueError: for a window smaller than one block, or an activation the tower
        does not compute, naming the config key.
    """

    def __init__(self, config: Any, comm: Communicator) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.hidden = config.hidden_size
        self.window = config.window_size // self.merge // config.patch_size  # in blocks
        if self.window < 1:
            raise ValueError(f"vision_config.window_size={config.window_size} is below one "
                             f"{self.merge}x{self.merge} block of {config.patch_size}-pixel "
                             "patches")
        if config.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act={config.hidden_act!r} is not "
                             "supported; only 'silu'")
        self.full_attention = frozenset(config.fullatt_block_indexes)
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = config.hidden_size // config.num_heads
        self.patch_embed = nn.Parameter(torch.empty(
            config.hidden_size, config.in_channels, config.temporal_patch_size,
            config.patch_size, config.patch_size), requires_grad=False)
        self.patch_embed.weight_loader = default_weight_loader
        self.blocks = nn.ModuleList(VisionBlock(config, comm) for _ in range(config.depth))
        self.merger = PatchMerger(config, comm)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid], ops: OpSet
                ) -> torch.Tensor:
        weight = self.patch_embed
        x = F.linear(pixels.to(weight.dtype), weight.view(self.hidden, -1))
        unit = self.merge ** 2
        order, window_lens = self._windows(grids)
        order = order.to(x.device)
        x = x.view(-1, unit, self.hidden)[order].view(-1, self.hidden)
        rotary = self._rotary(grids, order, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        full, windows = _segments(frames, x.device), _segments(window_lens, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, full if i in self.full_attention else windows, ops)
        return self.merger(x, ops)[torch.argsort(order)]

    def _windows(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, list[int]]:
        """The blocks in window order (indices into the images' blocks, block-major), and
        each window's length in patches (transformers' ``get_vision_window_index``)."""
        order: list[torch.Tensor] = []
        lens: list[int] = []
        first, size = 0, self.window
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            blocks = torch.arange(t * rows * cols).view(t, rows, cols) + first
            for frame in blocks:
                for r in range(0, rows, size):
                    for c in range(0, cols, size):
                        window = frame[r:r + size, c:c + size].reshape(-1)
                        order.append(window)
                        lens.append(window.numel() * self.merge ** 2)
            first += t * rows * cols
        return torch.cat(order), lens

    def _rotary(self, grids: Sequence[Grid], order: torch.Tensor, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (cos, sin) [N, 1, head_dim] of each patch's (row, column), in window
        order: half the frequencies by row, half by column, as transformers' axial rope."""
        spatial = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        rows, cols = [], []
        for t, h, w in grids:  # block-major: each merge x merge block's patches in a row
            m = self.merge
            shape = (h // m, m, w // m, m)
            r = torch.arange(h).view(h, 1).expand(h, w).reshape(shape).transpose(1, 2)
            c = torch.arange(w).view(1, w).expand(h, w).reshape(shape).transpose(1, 2)
            rows.append(r.flatten().repeat(t))
            cols.append(c.flatten().repeat(t))
        pos = torch.stack((torch.cat(rows), torch.cat(cols)), dim=-1).to(device)
        freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]
        unit = self.merge ** 2
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].view(-1, freqs.shape[-1])
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat((cos, cos), -1).unsqueeze(1),
                torch.cat((-sin, sin), -1).unsqueeze(1))

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, Any]:
        """Our (parameter name, shard id or None) for a tower tensor's Hugging Face name
        (without the tower's prefix)."""
        if name == "patch_embed.proj.weight":
            return "patch_embed", None
        for theirs, shard in ((".mlp.gate_proj.", 0), (".mlp.up_proj.", 1)):
            if theirs in name:
                return name.replace(theirs, ".gate_up_proj."), shard
        return (name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.")
                .replace(".mlp.down_proj.", ".down_proj."), None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face-named tower tensors (without the tower's prefix) into the
        parameters; returns the parameters now completely loaded.

        :raises ValueError: naming a tensor that has no parameter here."""
        from quire.models.llama import load_tensors

        return load_tensors(self, weights, self.checkpoint_name, lambda _: frozenset({0, 1}))


def _segments(lens: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``ops.bidirectional_attention``'s (starts [S+1], lengths) of consecutive
    segments."""
    starts = torch.tensor([0, *lens], device=device).cumsum(0)
    return starts, lens
