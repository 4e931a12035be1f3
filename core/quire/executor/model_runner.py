"""The model runner: turns one scheduled step into one flattened forward pass.

It owns the model and the per-layer KV tensors. A step arrives as
:class:`~quire.executor.messages.StepItem` s (each sequence's new tokens, start and page
table: what a worker process receives), never as sequences. Per step it builds, on the
device:

- ``input_ids`` and ``positions`` [T]: each sequence's new tokens, concatenated;
- the :class:`~quire.interfaces.attention.AttentionBatch` (slot mapping, query offsets,
  sequence lengths, block tables) that the attention backend turns into its metadata;
- the rows whose logits are due: the last new token of each sequence that reaches the
  end of its known tokens (a prefill chunk that stops short samples nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quire.executor.messages import StepItem
from quire.interfaces.attention import AttentionBackend, AttentionBatch
from quire.models.context import ForwardContext
from quire.models.pipeline import PipelineLink
from quire.models.pooling import PoolingConfig
from quire.ops import OpSet, reference_ops


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    #: Rows of the flattened batch whose logits are sampled, and their sequences' indices
    #: in the scheduled list.
    sample_rows: torch.Tensor
    sample_items: tuple[int, ...]
    #: For sequences that want prompt logprobs: (index in the scheduled list, position of
    #: the first row, the rows) of prompt positions whose next token is a prompt token.
    prompt_rows: tuple[tuple[int, int, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class StepResult:
    #: float32 [N, vocab] for the N sampling sequences (rows follow ``sample_items``).
    logits: torch.Tensor
    #: Indices in the scheduled list of the sequences that sample.
    sample_items: tuple[int, ...]
    #: (index in the scheduled list, first position, float32 logits [k, vocab]) for
    #: prompt positions ``first .. first+k-1``, which predict prompt tokens ``first+1 ..``.
    prompt_logits: tuple[tuple[int, int, torch.Tensor], ...] = ()
    #: An embedding model's float32 [N, hidden] pooled vectors (rows follow
    #: ``sample_items``; ``logits`` is then empty), None for a generating model.
    pooled: torch.Tensor | None = None


class ModelRunner:
    """Runs the model for scheduled steps. One per engine; not thread-safe."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor | None],
        block_size: int,
        device: torch.device,
        link: PipelineLink | None = None,
        ops: OpSet | None = None,
        pooling: PoolingConfig | None = None,
    ) -> None:
        """:param kv_caches: one per layer of the model, by global layer index (None for
            a layer another pipeline stage holds).
        :param link: this pipeline stage's neighbours, or None without pipelining.
        :param ops: the platform's ops (the reference set when None).
        :param pooling: for an embedding model, how each finished prompt becomes one
            vector (then no logits are computed); None to generate."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.link = link
        self.ops = ops if ops is not None else reference_ops()
        self.pooling = pooling

    def prepare(self, scheduled: list[StepItem]) -> StepInputs:
        """Build the flattened inputs of one step."""
        bs = self.block_size
        query_lens = [len(s.token_ids) for s in scheduled]
        starts = [s.start for s in scheduled]
        token_ids: list[int] = []
        for s in scheduled:
            token_ids.extend(s.token_ids)
        max_blocks = max(len(s.block_table) for s in scheduled)
        tables = [list(s.block_table) + [0] * (max_blocks - len(s.block_table))
                  for s in scheduled]

        dev = self.device
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)
        # position of token t = its sequence's start + its offset within the sequence's rows
        positions = (torch.arange(int(query_start_loc[-1]))
                     - query_start_loc[:-1][seq_index]
                     + torch.tensor(starts, dtype=torch.int64)[seq_index])
        block_tables = torch.tensor(tables, dtype=torch.int32)
        slots = (block_tables[seq_index, positions // bs].to(torch.int64) * bs
                 + positions % bs)
        sample_items = tuple(i for i, s in enumerate(scheduled) if s.samples)
        sample_rows = query_start_loc[1:][list(sample_items)] - 1
        prompt_rows = []
        for i, s in enumerate(scheduled):
            count = s.prompt_logit_rows
            if count > 0:
                first_row = int(query_start_loc[i])
                prompt_rows.append((i, s.start, torch.arange(first_row, first_row + count,
                                                             device=dev)))

        seq_lens = [s.end for s in scheduled]
        batch = AttentionBatch(
            slot_mapping=slots.to(dev),
            query_start_loc=query_start_loc.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens=tuple(query_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            batch=batch,
            sample_rows=sample_rows.to(dev),
            sample_items=sample_items,
            prompt_rows=tuple(prompt_rows),
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[StepItem]) -> StepResult:
        """Run one forward. Writes the step's K/V into the pages."""
        inputs = self.prepare(scheduled)
        ctx = ForwardContext(
            backend=self.backend,
            metadata=self.backend.build_metadata(inputs.batch),
            kv_caches=self.kv_caches,
            ops=self.ops,
            batch=inputs.batch,
        )
        if self.link is None:
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        else:  # a pipeline stage: continue the previous stage's, hand on to the next
            intermediate = (None if self.link.stage.is_first
                            else self.link.recv(inputs.input_ids.shape[0]))
            out = self.model(inputs.input_ids, inputs.positions, ctx, intermediate)
            if isinstance(out, tuple):
                self.link.send(*out)
                return StepResult(out[0].new_empty((0, 0), dtype=torch.float32),
                                  inputs.sample_items)
            hidden = out
        if self.pooling is not None:
            return self._pool(hidden, inputs, self.pooling)
        if inputs.sample_items:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
        else:
            logits = hidden.new_empty((0, 0), dtype=torch.float32)
        prompt_logits = tuple(
            (i, first, self.model.compute_logits(hidden[rows]))
            for i, first, rows in inputs.prompt_rows
        )
        return StepResult(logits, inputs.sample_items, prompt_logits)

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs,
              pooling: PoolingConfig) -> StepResult:
        """One vector per sequence whose prompt this step completed (an embedding
        model's prompt is never split, so that is every sequence of the step)."""
        pooled = self.ops.pool(hidden, inputs.batch.query_start_loc, pooling.method,
                               pooling.normalize)
        return StepResult(hidden.new_empty((0, 0), dtype=torch.float32),
                          inputs.sample_items, (),
                          pooled[list(inputs.sample_items)].to("cpu"))
