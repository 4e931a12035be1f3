"""The model runner: turns one scheduled step into one flattened forward pass.

It owns the model, the per-layer KV tensors and the persistent
:class:`~quire.executor.input_batch.InputBatch`. A step arrives as
:class:`~quire.executor.messages.StepItem` s (each sequence's new tokens, start and the
pages of its table the workers have not seen: what a worker process receives), never as
sequences. Per step the input batch fills, on the device:

- ``input_ids`` and ``positions`` [T]: each sequence's new tokens, concatenated;
- the :class:`~quire.interfaces.attention.AttentionBatch` (slot mapping, query offsets,
  sequence lengths, block tables) that the attention backend turns into its metadata;
- the rows whose logits are due: the last new token of each sequence that reaches the
  end of its known tokens (a prefill chunk that stops short samples nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from quire.executor.drafter import Drafter, EagleDrafter, StageProposals
from quire.executor.encoder_cache import ImageEmbeddings, image_blocks
from quire.executor.graphs import DecodeGraphs
from quire.executor.input_batch import InputBatch, StepInputs, StepLimits
from quire.executor.messages import StepItem
from quire.interfaces.attention import AttentionBackend
from quire.interfaces.platform import GraphCapture
from quire.lora.layers import LoRAManager
from quire.models.context import ForwardContext
from quire.models.image_blocks import ImageBlocks
from quire.models.pipeline import PipelineLink
from quire.models.pooling import PoolingConfig
from quire.ops import OpSet, reference_ops

__all__ = ["ModelRunner", "StepInputs", "StepResult", "StepLimits"]


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
    #: With a draft model: each scheduled item's proposals, which the forward verified
    #: in place of its stand-ins (empty for items without drafts); None without one.
    drafts: tuple[tuple[int, ...], ...] | None = None


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
        limits: StepLimits | None = None,
        drafter: Drafter | EagleDrafter | StageProposals | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """:param kv_caches: one per layer of the model, by global layer index (None for
            a layer another pipeline stage holds).
        :param link: this pipeline stage's neighbours, or None without pipelining.
        :param ops: the platform's ops (the reference set when None).
        :param pooling: for an embedding model, how each finished prompt becomes one
            vector (then no logits are computed); None to generate.
        :param limits: the largest step, for the input batch's buffers (they grow from
            small ones when None).
        :param drafter: a draft model or an EAGLE head that fills each item's draft
            stand-ins before the forward (speculative decoding; on a first pipeline
            stage, the proposals a head on the last stage sends), or None.
        :param lora: the LoRA adapters' slots, told each step's adapters (``StepItem.
            lora_id``), or None."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.link = link
        self.ops = ops if ops is not None else reference_ops()
        self.pooling = pooling
        self.input_batch = InputBatch(block_size, device, limits)
        #: Captured decode forwards (:meth:`capture_graphs`), or None: all steps eager.
        self.graphs: DecodeGraphs | None = None
        self.drafter = drafter
        self.lora = lora
        #: An image-text model's image embeddings (on the first pipeline stage, which
        #: embeds tokens), or None.
        self.images = (ImageEmbeddings() if hasattr(model, "embed_images")
                       and (link is None or link.stage.is_first) else None)
        #: The model reads M-RoPE positions (``ForwardContext.mrope_positions``).
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))

    @torch.inference_mode()
    def capture_graphs(self, capture: GraphCapture, sizes: Sequence[int],
                       max_seq_len: int) -> None:
        """Capture the decode forward at each batch size of ``sizes``; later decode-only
        steps that fit replay them (:mod:`quire.executor.graphs`). Call once, after the
        KV cache holds its final tensors.

        :raises ValueError: for a pipeline stage or an embedding model (they run eagerly).
        :raises RuntimeError: from :meth:`DecodeGraphs.capture_all`.
        """
        if self.link is not None or self.pooling is not None:
            raise ValueError("graphs capture a whole model's decode forward: not a pipeline "
                             "stage's, nor an embedding model's")
        graphs = DecodeGraphs(capture, sizes, block_size=self.block_size,
                              max_seq_len=max_seq_len, device=self.device)
        graphs.capture_all(self.model, self.backend, self.kv_caches, self.ops)
        self.graphs = graphs

    def prepare(self, scheduled: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None) -> StepInputs:
        """The flattened inputs of one step (valid until the next call); forgets the
        ``released`` sequences first."""
        return self.input_batch.prepare(scheduled, released, sampled)

    @torch.inference_mode()
    def execute(self, scheduled: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None) -> StepResult:
        """Run one forward. Writes the step's K/V into the pages.

        :param sampled: the previous step's sampled token ids on this device, for items
            with a pending token (``StepItem.prev_row``; async scheduling)."""
        drafts = None
        released = tuple(released)  # read twice: the input batch, the image entries
        if self.drafter is not None:
            scheduled, drafts = self.drafter.propose(scheduled, released, sampled)
        inputs = self.prepare(scheduled, released, sampled)
        if self.lora is not None:
            self.lora.prepare([item.lora_id for item in scheduled],
                              [len(item.token_ids) for item in scheduled],
                              {item.lora_id: item.lora_path for item in scheduled
                               if item.lora_path}, self.device)
        mm = blocks = None
        if self.images is not None:
            mm = self.images.step(scheduled, self.model, self.ops, self.device)
            self.images.release(released)
        if getattr(self.model, "bidirectional_images", False):  # on every stage
            blocks = image_blocks(scheduled, self.backend, inputs.batch)
        mrope = self._mrope_positions(scheduled) if self.uses_mrope else None
        # a decode step that fits a captured graph replays it (never one with images);
        # without image rows every token is text, whose three M-RoPE positions are
        # equal: the captured one-position forward takes the first row
        hidden = (None if self.graphs is None or mm is not None or blocks is not None
                  else self.graphs.replay(inputs if mrope is None
                                          else replace(inputs, positions=mrope[0])))
        if hidden is None and self.link is None:
            hidden = self.model(inputs.input_ids, inputs.positions,
                                self._context(inputs, mm, blocks, mrope))
        elif hidden is None:  # a pipeline stage: continue the previous stage's, hand on
            ctx = self._context(inputs, mm, blocks, mrope)
            intermediate = (None if self.link.stage.is_first
                            else self.link.recv(inputs.input_ids.shape[0]))
            out = self.model(inputs.input_ids, inputs.positions, ctx, intermediate)
            if isinstance(out, tuple):  # not the last stage: a first one's drafts go back
                self.link.send(*out)
                return StepResult(out[0].new_empty((0, 0), dtype=torch.float32),
                                  inputs.sample_items, drafts=drafts)
            hidden = out
        if self.pooling is not None:
            return self._pool(hidden, inputs, self.pooling)
        if self.drafter is not None:
            self.drafter.keep(scheduled, hidden)
        if inputs.sample_items:
            logits = self._logits(hidden, inputs.sample_rows)
        else:
            logits = hidden.new_empty((0, 0), dtype=torch.float32)
        prompt_logits = tuple(
            (i, first, self._logits(hidden, rows)) for i, first, rows in inputs.prompt_rows
        )
        return StepResult(logits, inputs.sample_items, prompt_logits, drafts=drafts)

    def _logits(self, hidden: torch.Tensor, rows: Any) -> torch.Tensor:
        """The LM head on ``hidden[rows]`` (its LoRA updates told which rows those are)."""
        if self.lora is not None:
            self.lora.select_rows(rows)
        return self.model.compute_logits(hidden[rows])

    def _context(self, inputs: StepInputs,
                 mm: tuple[torch.Tensor, torch.Tensor] | None = None,
                 blocks: ImageBlocks | None = None,
                 mrope: torch.Tensor | None = None) -> ForwardContext:
        return ForwardContext(backend=self.backend,
                              metadata=self.backend.build_metadata(inputs.batch),
                              kv_caches=self.kv_caches, ops=self.ops, batch=inputs.batch,
                              mm_embeds=mm, mm_blocks=blocks, mrope_positions=mrope)

    def _mrope_positions(self, items: list[StepItem]) -> torch.Tensor:
        """The step's M-RoPE positions, int64 [3, T]: each item's own, or three copies of
        its positions in the sequence (no images)."""
        rows = []
        for item in items:
            n = len(item.token_ids)
            if item.mrope_positions:
                rows.append(np.asarray(item.mrope_positions, dtype=np.int64).reshape(3, n))
            else:
                rows.append(np.broadcast_to(np.arange(item.start, item.start + n), (3, n)))
        return torch.from_numpy(np.concatenate(rows, axis=1)).to(self.device)

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs,
              pooling: PoolingConfig) -> StepResult:
        """One vector per sequence whose prompt this step completed (an embedding
        model's prompt is never split, so that is every sequence of the step)."""
        pooled = self.ops.pool(hidden, inputs.batch.query_start_loc, pooling.method,
                               pooling.normalize)
        return StepResult(hidden.new_empty((0, 0), dtype=torch.float32),
                          inputs.sample_items, (),
                          pooled[list(inputs.sample_items)].to("cpu"))
