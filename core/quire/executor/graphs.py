"""Decode steps replayed from device graphs (vLLM's CUDA graph runner, for any platform
whose :meth:`~quire.interfaces.platform.Platform.graph_capture` records graphs).

The model's decode forward is captured once per batch size of a ladder (1, 2, 4, 8, 16,
... up to ``max_num_seqs``); a decode-only step of ``b`` sequences is padded to the
smallest captured size ``B >= b`` and runs as one replay. Everything else runs eagerly.

===========  ============================================================================
buffers      The graphs' inputs (token ids, positions and the attention batch: slots,
             query offsets, lengths, page tables as wide as ``max_seq_len`` needs) live
             in tensors made once; graph ``B`` reads their first ``B`` rows, so no address
             ever changes. A step's inputs (the input batch's, which may grow and move)
             are copied in, ``b`` rows each, and the backend refills the captured
             metadata in place (``AttentionBackend.update_metadata``).
padding      Rows ``b..B-1`` are dummies: token 0 at position 0, length 1, page 0, slot
             :data:`PAD_SLOT` (negative: no backend or op writes it). Their outputs are
             junk and never read; a decoder computes each row apart from the others.
eager        Steps where a sequence has more than one new token (prefills, chunks),
             steps of more sequences than the largest size, sequences longer than the
             capture's ``max_seq_len``.
===========  ============================================================================
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quire.executor.input_batch import StepInputs
from quire.interfaces.attention import AttentionBackend, AttentionBatch
from quire.interfaces.platform import GraphCapture
from quire.models.context import ForwardContext
from quire.ops import OpSet

#: The slot of a padding row: backends and ops skip negative slots
#: (``AttentionBackend.kv_slots``), so a padded row writes no page.
PAD_SLOT = -1


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (always
    the last, so every decode step the scheduler can form has a graph)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    ladder = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    if ladder[-1] != max_num_seqs:
        ladder.append(max_num_seqs)
    return tuple(ladder)


@dataclass(frozen=True)
class _Graph:
    replay: Callable[[], torch.Tensor]
    batch: AttentionBatch
    metadata: Any


class DecodeGraphs:
    """One model runner's captured decode forwards, by batch size. Not thread-safe."""

    def __init__(self, capture: GraphCapture, sizes: Sequence[int], *, block_size: int,
                 max_seq_len: int, device: torch.device) -> None:
        """:param sizes: the batch sizes to capture (:func:`capture_sizes`).
        :param max_seq_len: the longest sequence a replayed step may hold (the engine's
            ``max_model_len``); sizes the page tables and the backend's decode split."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be >= 1, got {tuple(sizes)}")
        self._capture = capture
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        n, pages = self.sizes[-1], -(-max_seq_len // block_size)

        def make(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self._input_ids, self._positions = make(n), make(n)
        self._slots, self._seq_lens = make(n), make(n)
        self._query_start_loc = torch.arange(n + 1, device=device)  # one token per row
        self._tables = make(n, pages, dtype=torch.int32)
        self._graphs: dict[int, _Graph] = {}
        self._backend: AttentionBackend | None = None
        #: Steps replayed, and steps run eagerly (for the logs and the tests).
        self.replays = 0
        self.eager_steps = 0

    def capture_all(self, model: nn.Module, backend: AttentionBackend,
                    kv_caches: list[torch.Tensor | None], ops: OpSet) -> None:
        """Capture the decode forward at every size, the largest first (the graphs share
        the platform's memory pool). Each size runs once eagerly first, to compile its
        kernels; all rows are padding then, so no page changes.

        :raises RuntimeError: naming the backend when it cannot refill its metadata in
            place, or the size whose capture failed (``enforce_eager`` runs without).
        """
        self._pad(0, self.sizes[-1])
        for size in reversed(self.sizes):
            batch = self._batch(size)
            metadata = backend.build_metadata(batch)
            if not backend.update_metadata(metadata, batch):
                raise RuntimeError(
                    f"the '{backend.name}' attention backend cannot refill its metadata in "
                    "place (AttentionBackend.update_metadata), so steps cannot replay "
                    "graphs; run with enforce_eager (--enforce-eager)")
            ctx = ForwardContext(backend=backend, metadata=metadata, kv_caches=kv_caches,
                                 ops=ops, batch=batch)
            forward = _decode_forward(model, self._input_ids[:size],
                                      self._positions[:size], ctx)
            forward()  # warm-up: compiles this size's kernels outside the capture
            try:
                replay = self._capture.capture(forward)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode forward of {size} sequences failed: {exc}; run "
                    "with enforce_eager (--enforce-eager) to run without graphs") from exc
            self._graphs[size] = _Graph(replay, batch, metadata)
        self._backend = backend

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The hidden states ``[b, H]`` of a decode-only step, replayed at the smallest
        captured size that holds it (valid until the next replay); None when the step
        must run eagerly."""
        size = self._size_for(inputs)
        graph = None if size is None else self._graphs.get(size)
        if graph is None or self._backend is None:
            self.eager_steps += 1
            return None
        batch, b = inputs.batch, inputs.batch.num_seqs
        width = batch.block_tables.shape[1]
        self._input_ids[:b].copy_(inputs.input_ids)
        self._positions[:b].copy_(inputs.positions)
        self._slots[:b].copy_(batch.slot_mapping)
        self._seq_lens[:b].copy_(batch.seq_lens)
        self._tables[:b, :width].copy_(batch.block_tables)
        self._pad(b, size)
        if not self._backend.update_metadata(graph.metadata, graph.batch):
            raise RuntimeError(f"the '{self._backend.name}' attention backend refused to "
                               f"refill the metadata it accepted at capture (size {size})")
        self.replays += 1
        return graph.replay()[:b]

    def _size_for(self, inputs: StepInputs) -> int | None:
        """The captured size a step pads to, or None: it runs eagerly."""
        batch = inputs.batch
        b = batch.num_seqs
        if (batch.num_tokens != b or batch.max_query_len != 1 or inputs.prompt_rows
                or b > self.sizes[-1] or batch.max_seq_len > self.max_seq_len
                or batch.block_size != self.block_size
                or batch.block_tables.shape[1] > self._tables.shape[1]):
            return None
        return self.sizes[bisect_left(self.sizes, b)]

    def _batch(self, size: int) -> AttentionBatch:
        """The attention batch graph ``size`` reads: leading slices of the buffers."""
        return AttentionBatch(
            slot_mapping=self._slots[:size], query_start_loc=self._query_start_loc[:size + 1],
            seq_lens=self._seq_lens[:size], block_tables=self._tables[:size],
            block_size=self.block_size, max_query_len=1, max_seq_len=self.max_seq_len,
            query_lens=(1,) * size)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows ``lo..hi-1`` become padding (see the module docstring)."""
        if hi <= lo:
            return
        self._input_ids[lo:hi] = 0
        self._positions[lo:hi] = 0
        self._slots[lo:hi] = PAD_SLOT
        self._seq_lens[lo:hi] = 1
        self._tables[lo:hi] = 0


def _decode_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext) -> Callable[[], torch.Tensor]:
    """The work one graph records: the model's forward on fixed inputs."""
    def forward() -> torch.Tensor:
        return model(input_ids, positions, ctx)
    return forward
