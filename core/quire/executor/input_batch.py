"""The persistent input batch: a step's model inputs in buffers made once, updated by
what changed.

The runner keeps, per live sequence, a row of page ids (its block table) that steps only
change by what they bring: a new or resumed sequence sends its whole table, a running one
only the pages added since the workers last saw it (:class:`~quire.executor.messages.
StepItem`'s ``first_page``), and finished or preempted sequences are released. Each step
then fills fixed buffers (token ids, positions, slot mapping, query offsets, sequence
lengths, the step's block tables) with numpy on the host, in a few vectorised
operations, and copies them once into their device twins (the same tensors on the cpu).

Every tensor a step hands out is a leading slice of a buffer made once: the addresses a
later graph capture needs stay fixed while the engine serves, as long as no step exceeds
the sizes the buffers were made for (the worker makes them at the configuration's
limits; beyond them they grow, which moves them). A step's tensors are valid until the
next call to :meth:`InputBatch.prepare`.

A token still on the device (async scheduling: ``StepItem.prev_row``) is copied into the
device's ``input_ids`` from the previous step's sampled ids, after the host's copy, so a
replayed graph, which copies ``input_ids`` into its own buffer, reads it too.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from quire.executor.messages import StepItem
from quire.interfaces.attention import AttentionBatch


@dataclass(frozen=True)
class StepLimits:
    """The most one step holds: the input batch's buffers are made at these sizes."""

    max_num_seqs: int = 8
    max_num_tokens: int = 256
    #: Pages of the longest sequence (``ceil(max_model_len / block_size)``).
    max_pages: int = 16

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_tokens, self.max_pages) < 1:
            raise ValueError(f"step limits must be >= 1, got {self}")


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    #: Rows of the flattened batch whose logits are sampled, and their sequences' indices
    #: in the scheduled list (an item with drafts once per row: its last ``1 + num_spec``
    #: tokens, in order).
    sample_rows: torch.Tensor
    sample_items: tuple[int, ...]
    #: For sequences that want prompt logprobs: (index in the scheduled list, position of
    #: the first row, the rows) of prompt positions whose next token is a prompt token.
    prompt_rows: tuple[tuple[int, int, torch.Tensor], ...] = ()


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def untouched_zeros(shape: int | tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeros in fresh pages of their own (an anonymous map), which the OS makes resident
    only when they are first written. ``np.zeros`` does not promise that: its calloc
    may take reused heap memory and clear it, once the heap's threshold for mapping has
    risen above the size (glibc raises it as large blocks are freed)."""
    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * np.dtype(dtype).itemsize,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=dtype, count=count).reshape(shape)


class _Buffers:
    """One step's inputs, made once at the largest sizes (int64 but the block tables).

    On the host they are :func:`untouched_zeros`: a step writes only the front of each,
    and the rest (most of the block tables, ``max_num_seqs`` rows of the longest
    context's pages) holds no memory until a step reaches it."""

    def __init__(self, max_seqs: int, max_tokens: int, max_pages: int,
                 device: torch.device) -> None:
        def make(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            if device.type == "cpu":
                return torch.from_numpy(untouched_zeros(n, _NUMPY_DTYPES[dtype]))
            return torch.zeros(n, dtype=dtype, device=device)

        self.input_ids = make(max_tokens)
        self.positions = make(max_tokens)
        self.slot_mapping = make(max_tokens)
        self.query_start_loc = make(max_seqs + 1)
        self.seq_lens = make(max_seqs)
        self.sample_rows = make(max_tokens)  # drafts sample at every token
        #: [B, w] tables viewed out of one flat buffer, so every step's is contiguous.
        self.block_tables = make(max_seqs * max_pages, torch.int32)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                self.seq_lens, self.sample_rows, self.block_tables)


class InputBatch:
    """Sequences' page tables across steps, and the buffers each step's inputs go to.
    One per model runner; not thread-safe."""

    def __init__(self, block_size: int, device: torch.device,
                 limits: StepLimits | None = None) -> None:
        """:param limits: the largest step; beyond it the buffers grow (small ones when
            None). Rows of page tables are made for ``max_num_seqs`` sequences."""
        self.block_size = block_size
        self.device = torch.device(device)
        self._row_of: dict[int, int] = {}  # seq_id -> its row of the page tables
        self._free_rows: list[int] = []
        self._num_pages = np.zeros(0, dtype=np.int64)  # pages held, per row
        self._tables = np.zeros((0, 0), dtype=np.int32)  # page ids, per row
        limits = limits or StepLimits()
        self._grow_tables(limits.max_num_seqs, limits.max_pages)
        self._make_buffers(limits.max_num_seqs, limits.max_num_tokens, limits.max_pages)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        """Sequences whose pages the batch holds."""
        return len(self._row_of)

    def pages_of(self, seq_id: int) -> list[int]:
        """The page table held for ``seq_id`` (empty when it holds none)."""
        row = self._row_of.get(seq_id)
        return [] if row is None else self._tables[row, : self._num_pages[row]].tolist()

    def num_pages_of(self, seq_id: int) -> int:
        """How many pages the batch holds for ``seq_id`` (0 when none)."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else int(self._num_pages[row])

    def _grow_tables(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self._tables.shape
        rows, cols = max(rows, old_rows), max(cols, old_cols)
        if (rows, cols) == (old_rows, old_cols):
            return
        tables = untouched_zeros((rows, cols), np.int32)
        tables[:old_rows, :old_cols] = self._tables
        self._tables = tables
        self._num_pages = np.concatenate(
            (self._num_pages, np.zeros(rows - old_rows, dtype=np.int64)))
        self._free_rows.extend(range(rows - 1, old_rows - 1, -1))  # lowest row first out

    def _make_buffers(self, max_seqs: int, max_tokens: int, max_pages: int) -> None:
        self._limits = (max_seqs, max_tokens, max_pages)
        self._host = _Buffers(max_seqs, max_tokens, max_pages, torch.device("cpu"))
        self._np = [t.numpy() for t in self._host.tensors()]
        self._dev = (self._host if self.device.type == "cpu"
                     else _Buffers(max_seqs, max_tokens, max_pages, self.device))

    def _fit(self, num_seqs: int, num_tokens: int, num_pages: int) -> None:
        """Grow the step buffers (to twice what is needed) when a step exceeds them."""
        seqs, tokens, pages = self._limits
        if num_seqs > seqs or num_tokens > tokens or num_pages > pages:
            self._make_buffers(max(seqs, 2 * num_seqs), max(tokens, 2 * num_tokens),
                               max(pages, 2 * num_pages))

    # -- what changed ----------------------------------------------------------------------
    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished or preempted sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._num_pages[row] = 0
                self._free_rows.append(row)

    def apply(self, items: Iterable[StepItem], released: Iterable[int] = ()) -> None:
        """Release ``released`` and apply the items' pages, without a step (a runner
        that skips a forward keeps its tables in step with the others')."""
        self.release(released)
        for item in items:
            self._update(item)

    def _update(self, item: StepItem) -> int:
        """Apply ``item``'s pages to its sequence's row; returns the row.

        :raises ValueError: when the item continues a table the batch does not hold (a
            step was lost, or a sequence was released too early).
        """
        row = self._row_of.get(item.seq_id)
        if row is None:
            if item.first_page:
                raise ValueError(
                    f"sequence {item.seq_id} sends pages from {item.first_page} on, but the "
                    "input batch holds none of its earlier pages")
            if not self._free_rows:
                self._grow_tables(2 * self._tables.shape[0], 0)
            row = self._free_rows.pop()
            self._row_of[item.seq_id] = row
        first, pages = item.first_page, item.block_table
        if first > self._num_pages[row]:
            raise ValueError(
                f"sequence {item.seq_id} sends pages from {first} on, but the input batch "
                f"holds only {self._num_pages[row]} of its pages")
        end = first + len(pages)
        if pages:
            if end > self._tables.shape[1]:
                self._grow_tables(0, 2 * end)
            self._tables[row, first:end] = pages
        self._num_pages[row] = end
        return row

    # -- the step --------------------------------------------------------------------------
    def prepare(self, items: Sequence[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None) -> StepInputs:
        """Release ``released``, apply the items' pages, and fill the step's buffers.

        :param sampled: the previous step's sampled token ids (int64 [N], on this
            device), whose row ``item.prev_row`` is the item's last token.
        :raises ValueError: as :meth:`_update`, for an empty step, for a sequence
            whose pages do not hold its new tokens, or for a pending token without
            ``sampled``.
        """
        if not items:
            raise ValueError("a step needs at least one sequence")
        self.release(released)
        # one pass over the items gathers every per-sequence figure (per step, per item)
        update = self._update
        rows_list, q_lens_list, starts_list, token_ids, sampling = [], [], [], [], []
        num_spec = 0
        for i, item in enumerate(items):
            rows_list.append(update(item))
            ids = item.token_ids
            q_lens_list.append(len(ids))
            starts_list.append(item.start)
            token_ids += ids
            if item.samples:
                sampling.append(i)
                num_spec += item.num_spec
        rows = np.array(rows_list, dtype=np.int64)
        bs = self.block_size
        b = len(items)
        q_lens = np.array(q_lens_list, dtype=np.int64)
        starts = np.array(starts_list, dtype=np.int64)
        t = len(token_ids)
        ends = starts + q_lens
        held = self._num_pages[rows]
        short = np.flatnonzero(held * bs < ends)
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {items[i].seq_id} reaches position {ends[i] - 1} "
                             f"with {held[i]} page(s) of {bs} tokens")
        width = int(held.max())
        self._fit(b, t, width)
        ids, pos, slots, qsl, lens, sample, tables = self._np

        ids[:t] = token_ids
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1 : b + 1])
        lens[:b] = ends
        step_tables = tables[: b * width].reshape(b, width)
        np.take(self._tables[:, :width], rows, axis=0, out=step_tables)
        if t == b:  # decode only: one token per sequence, at its start
            pos[:t] = starts
            seq_index = np.arange(b)
        else:  # token k of a sequence sits at its start + k
            seq_index = np.repeat(np.arange(b), q_lens)
            pos[:t] = np.arange(t) - qsl[:b][seq_index] + starts[seq_index]
        p = pos[:t]
        slots[:t] = step_tables[seq_index, p // bs].astype(np.int64) * bs + p % bs
        if not num_spec:
            sample_items = tuple(sampling)
            sample[: len(sample_items)] = qsl[1 : b + 1][sampling] - 1
        else:  # an item with drafts samples its last 1 + num_spec tokens, in order
            counts = np.array([1 + items[i].num_spec for i in sampling], dtype=np.int64)
            sample_items = tuple(np.repeat(np.array(sampling, dtype=np.int64),
                                           counts).tolist())
            firsts = np.repeat(qsl[1 : b + 1][sampling] - counts, counts)
            within = np.arange(len(sample_items)) - np.repeat(np.cumsum(counts) - counts,
                                                              counts)
            sample[: len(sample_items)] = firsts + within

        self._copy_to_device(t, b, len(sample_items), b * width)
        self._fill_pending(items, qsl, sampled)
        dev = self._dev
        batch = AttentionBatch(
            slot_mapping=dev.slot_mapping[:t],
            query_start_loc=dev.query_start_loc[: b + 1],
            seq_lens=dev.seq_lens[:b],
            block_tables=dev.block_tables[: b * width].view(b, width),
            block_size=bs,
            max_query_len=max(q_lens_list),
            max_seq_len=int(ends.max()),
            query_lens=tuple(q_lens_list),
        )
        return StepInputs(
            input_ids=dev.input_ids[:t],
            positions=dev.positions[:t],
            batch=batch,
            sample_rows=dev.sample_rows[: len(sample_items)],
            sample_items=sample_items,
            prompt_rows=self._prompt_rows(items, qsl),
        )

    def _copy_to_device(self, t: int, b: int, s: int, cells: int) -> None:
        """Host buffers to their device twins (nothing on the cpu); blocking copies, so
        the host buffers may be refilled as soon as this returns."""
        if self._dev is self._host:
            return
        for n, src, dst in zip((t, t, t, b + 1, b, s, cells), self._host.tensors(),
                               self._dev.tensors()):
            dst[:n].copy_(src[:n])

    def _fill_pending(self, items: Sequence[StepItem], qsl: np.ndarray,
                      sampled: torch.Tensor | None) -> None:
        """Write each pending token (an item's last) into the device's ``input_ids``
        from row ``prev_row`` of ``sampled``, without a trip through the host."""
        pending = [(int(qsl[i + 1]) - 1, item.prev_row)
                   for i, item in enumerate(items) if item.prev_row >= 0]
        if not pending:
            return
        if sampled is None:
            first = next(item.seq_id for item in items if item.prev_row >= 0)
            raise ValueError(f"sequence {first} has a pending token, but the step came "
                             "without the sampled token ids")
        where = torch.tensor([p for p, _ in pending], dtype=torch.int64, device=self.device)
        rows = torch.tensor([r for _, r in pending], dtype=torch.int64, device=sampled.device)
        tokens = sampled.index_select(0, rows).to(device=self.device, dtype=torch.int64)
        self._dev.input_ids.index_copy_(0, where, tokens)

    def _prompt_rows(self, items: Sequence[StepItem],
                     qsl: np.ndarray) -> tuple[tuple[int, int, torch.Tensor], ...]:
        rows = []
        for i, item in enumerate(items):
            count = item.prompt_logit_rows
            if count > 0:
                first_row = int(qsl[i])
                rows.append((i, item.start, torch.arange(first_row, first_row + count,
                                                         device=self.device)))
        return tuple(rows)
