"""The sampler: picks each sequence's next token from its logits, vectorised over the batch.

One call runs, for every row with that row's own parameters:

| step | rows | what |
| --- | --- | --- |
| raw logprobs | ``logprobs`` set | ``log_softmax`` of the logits as given (reported, not sampled) |
| processors | ``logits_processors`` set | the request's own callables, in order |
| allowed tokens | ``allowed_token_ids`` set | every other token to ``-inf`` |
| bad words | ``bad_words`` set | a bad word's last token to ``-inf`` where the output ends with the rest |
| logit bias | ``logit_bias`` set | add the bias |
| min_tokens | short of ``min_tokens`` | EOS and ``stop_token_ids`` to ``-inf`` |
| penalties | any penalty set | repetition (prompt + output), frequency, presence |
| greedy | ``temperature == 0`` | argmax of the penalised logits |
| temperature | the rest | divide by it |
| min-p, top-k, top-p | the rest | drop tokens (vLLM v1 order) |
| sample | the rest | exponential race: ``argmax(probs / Exponential(1))`` |

The parts live in :mod:`quire.sampling` (the argmax too: :mod:`quire.sampling.argmax`).
The sampler owns three pieces of state: the cached
:class:`~quire.sampling.batch.BatchParams` of the last composition, the token counts
inside it, and the generators (:class:`~quire.sampling.noise.NoiseSource`).

A call is two halves: :meth:`Sampler.sample_on_device` launches the work and the copies
to the host and returns at once; :meth:`Sampler.to_host` waits for those copies only and
builds the lists. Async scheduling submits the next step between the two, which then
reads the tokens on the device (:class:`DeviceSample`'s ``token_ids``).

Speculative decoding calls :meth:`Sampler.verify` instead: several rows per sequence,
each adjusted as above with the drafts before it counted as output, then the exact
rejection rule (:mod:`quire.sampling.rejection`). Rows are the sampler's own input type
(:class:`~quire.sampling.rows.SamplingRow`), which the engine's sequences satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quire.sampling.argmax import row_argmax
from quire.sampling.bad_words import ban_bad_words
from quire.sampling.batch import BatchParams, RandomRows, batch_key
from quire.sampling.filters import apply_min_p, apply_top_k_top_p
from quire.sampling.logprobs import (
    TokenLogprobs,
    compute_prompt_logprobs,
    token_logprob_tensors,
    token_logprobs_of,
)
from quire.sampling.noise import NoiseSource
from quire.sampling.processors import apply_logits_processors
from quire.sampling.rejection import verify as verify_drafts
from quire.sampling.rows import DraftRow, SamplingRow

__all__ = ["DeviceSample", "Sampler", "SamplerOutput", "TokenLogprobs", "VerifyOutput",
           "compute_prompt_logprobs"]


@dataclass
class SamplerOutput:
    """What one :meth:`Sampler.sample` call chose."""

    #: One token id per row, in row order.
    token_ids: list[int]
    #: Per row: the chosen token's raw logprob, rank and top ``params.logprobs``
    #: alternatives; None for rows whose ``params.logprobs`` is None.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class VerifyOutput:
    """What one :meth:`Sampler.verify` call chose, per sequence."""

    #: The accepted drafts followed by one token the target chose (1 .. k+1 tokens).
    token_ids: list[list[int]]
    #: Drafts accepted, per sequence.
    num_accepted: list[int]
    #: Per token of ``token_ids``: as :attr:`SamplerOutput.logprobs`.
    logprobs: list[list[TokenLogprobs | None]]


@dataclass
class DeviceSample:
    """What :meth:`Sampler.sample_on_device` chose, before it reaches the host."""

    #: int64 [N], one token id per row, on the logits' device.
    token_ids: torch.Tensor
    #: The rows that asked for logprobs, and their alternatives (resolved).
    logprob_rows: list[int] = field(default_factory=list)
    logprob_ks: list[int] = field(default_factory=list)
    #: Host copies (started, maybe not done; on the cpu, or without ``torch.Event``, the
    #: tensors themselves): the token ids, then the logprob tensors
    #: (:func:`~quire.sampling.logprobs.token_logprob_tensors`) when any row asked.
    host: tuple[torch.Tensor, ...] = ()
    #: Recorded after the copies on a device that copies asynchronously; None on the cpu.
    copied: torch.Event | None = None


class Sampler:
    """Chooses next tokens. One per engine; not thread-safe.

    :param eos_token_ids: the ids ``min_tokens`` keeps out until enough tokens exist.
    :param vocab_size: the width of the logits it will be given.
    :param seed: seeds the generator of rows whose request has no seed.

    Contract with the engine:

    * Call :meth:`sample` with one logits row per sequence that samples this step. The
      sequences' ``output_token_ids`` must hold every token sampled so far (append each
      step's token before the next call).
    * A sequence's ``params`` must not change while it lives; give each of the ``n``
      sequences of a request ``params.for_sequence(i)`` so that seeded requests draw
      ``seed + i`` per sequence.
    * Call :meth:`release` when a sequence finishes or is aborted, to drop its generator.
    """

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int, seed: int = 0):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self._noise = NoiseSource(seed)
        self._batch: BatchParams | None = None

    def sample(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        """Choose one token per row.

        :param logits: float32 [N, vocab_size], row i for ``seqs[i]``. Changed in place
            (bias, penalties and masks are applied to it); do not reuse it afterwards.
        :param seqs: the N sequences, distinct.
        :returns: the tokens, and logprobs for the rows that asked for them.
        :raises ValueError: mismatched shapes, or a ``logit_bias`` id past the vocabulary.
        """
        return self.to_host(self.sample_on_device(logits, seqs))

    def sample_on_device(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> DeviceSample:
        """:meth:`sample`'s device half: the same choice, left on the device, with its
        copies to the host started (nothing here waits for the device). The sequences'
        host state (outputs for penalties and ``min_tokens``) is read now.

        :raises ValueError: as :meth:`sample`.
        """
        if not seqs and logits.shape[0] == 0:  # any width: runners may return [0, 0]
            empty = torch.empty(0, dtype=torch.long)
            return DeviceSample(empty, host=(empty,))
        if logits.dim() != 2 or logits.shape != (len(seqs), self.vocab_size):
            raise ValueError(f"logits must be [{len(seqs)}, {self.vocab_size}] (one row per "
                             f"sequence), got {list(logits.shape)}")
        logits = logits.float()  # no-op for float32
        batch = self._batch_for(seqs, logits.device)
        raw_logprobs = (torch.log_softmax(logits[batch.logprobs.index], dim=-1)
                        if batch.logprobs else None)
        self._adjust(logits, batch)
        tokens = self._choose(logits, batch)
        out = DeviceSample(tokens)
        wanted: tuple[torch.Tensor, ...] = (tokens,)
        if batch.logprobs is not None and raw_logprobs is not None:
            out.logprob_rows, out.logprob_ks = batch.logprobs.rows, batch.logprobs.ks
            wanted += token_logprob_tensors(raw_logprobs, tokens[batch.logprobs.index],
                                            max(out.logprob_ks, default=0))
        if tokens.device.type == "cpu" or not hasattr(torch, "Event"):
            out.host = wanted  # no torch.Event before torch 2.5: to_host then syncs
        else:  # the copies queue behind this step's work, ahead of the next step's
            out.host = tuple(t.to("cpu", non_blocking=True) for t in wanted)
            out.copied = torch.Event(device=tokens.device)
            out.copied.record()
        return out

    @staticmethod
    def to_host(sample: DeviceSample) -> SamplerOutput:
        """:meth:`sample`'s host half: waits for the copies that
        :meth:`sample_on_device` started (not for later work on the device)."""
        if sample.copied is not None:
            sample.copied.synchronize()
        tokens = sample.host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if sample.logprob_rows:
            for row, entry in zip(sample.logprob_rows,
                                  token_logprobs_of(sample.host[1:], sample.logprob_ks)):
                logprobs[row] = entry
        return SamplerOutput(tokens, logprobs)

    def verify(self, logits: torch.Tensor, seqs: list[SamplingRow],
               drafts: list[list[int]]) -> VerifyOutput:
        """Speculative decoding: accept or reject each sequence's draft tokens by the
        exact rejection-sampling rule (:mod:`quire.sampling.rejection`), so that the
        tokens follow the target's distribution at any temperature.

        :param logits: float32 [sum(len(d) + 1), vocab]: for sequence i, its rows in
            order are the logits after its context, then after its context and the first
            ``1 .. len(drafts[i])`` drafts. Changed in place, as in :meth:`sample`.
        :param seqs: one row owner per sequence, as :meth:`sample` takes them.
        :param drafts: each sequence's draft tokens (deterministic proposals: n-gram).
        Every row is adjusted (bias, ``min_tokens``, penalties) as if the drafts before
        it had been sampled. Greedy rows accept a draft iff it is the argmax.

        :raises ValueError: as :meth:`sample`.
        """
        rows: list[SamplingRow] = []
        for seq, draft in zip(seqs, drafts, strict=True):
            rows.append(seq)
            rows.extend(DraftRow.extend(seq, draft[:j]) for j in range(1, len(draft) + 1))
        if logits.dim() != 2 or logits.shape != (len(rows), self.vocab_size):
            raise ValueError(f"logits must be [{len(rows)}, {self.vocab_size}] (a row per "
                             f"sequence and draft), got {list(logits.shape)}")
        logits = logits.float()
        # not cached: draft rows change every step; the sequences' counts are taken over
        batch = BatchParams.build(rows, self.vocab_size, self.eos_token_ids, logits.device,
                                  self._batch)
        raw_logprobs = (torch.log_softmax(logits[batch.logprobs.index], dim=-1)
                        if batch.logprobs else None)
        self._adjust(logits, batch)
        if batch.random is None:  # greedy rows read only the argmax: the logits give it
            probs, greedy = logits, torch.ones(len(rows), dtype=torch.bool,
                                               device=logits.device)
            uniforms = logits.new_zeros(len(rows))
            noise = logits.new_ones((1, 1)).expand(logits.shape)
        else:
            probs, greedy, uniforms, noise = self._verification_inputs(logits, batch)
        tokens, accepted = verify_drafts(probs, drafts, None, greedy, uniforms, noise)
        return VerifyOutput(tokens, accepted,
                            self._emitted_logprobs(raw_logprobs, batch, drafts, tokens))

    def _verification_inputs(self, logits: torch.Tensor, batch: BatchParams
                             ) -> tuple[torch.Tensor, ...]:
        """The rejection rule's inputs for a batch with random rows: each row's target
        distribution (a greedy row's one-hot on its argmax), which rows are greedy, and
        a uniform and an exponential noise row per random row, from its generator."""
        rnd = batch.random
        assert rnd is not None
        num_rows = logits.shape[0]
        greedy = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
        greedy[rnd.rows] = False
        uniforms = logits.new_zeros(num_rows)
        uniforms[rnd.rows] = self._noise.uniform(len(rnd.rows), logits.device, rnd.seeded,
                                                 rnd.unseeded)
        noise = torch.ones_like(logits)
        noise[rnd.rows] = self._noise.exponential(len(rnd.rows), self.vocab_size,
                                                  logits.device, rnd.seeded, rnd.unseeded)
        if batch.greedy_rows is not None:  # before the random rows' filters, in place
            best = row_argmax(logits[batch.greedy_rows])
        probs = self._random_probs(logits, rnd)
        if not rnd.all_rows:
            probs = torch.zeros_like(logits).index_copy_(0, rnd.rows, probs)
        if batch.greedy_rows is not None:
            probs[batch.greedy_rows] = 0.0
            probs[batch.greedy_rows, best] = 1.0
        return probs, greedy, uniforms, noise

    @staticmethod
    def _emitted_logprobs(raw: torch.Tensor | None, batch: BatchParams,
                          drafts: list[list[int]],
                          tokens: list[list[int]]) -> list[list[TokenLogprobs | None]]:
        """Each emitted token's logprobs, from the row that chose it."""
        out: list[list[TokenLogprobs | None]] = [[None] * len(t) for t in tokens]
        if raw is None or batch.logprobs is None:
            return out
        starts, first = [], 0
        for draft in drafts:
            starts.append(first)
            first += len(draft) + 1
        at = {row: i for i, row in enumerate(batch.logprobs.rows)}  # row -> raw's row
        picks = [(seq, t, at[starts[seq] + t]) for seq, emitted in enumerate(tokens)
                 for t in range(len(emitted)) if starts[seq] + t in at]
        if not picks:
            return out
        index = torch.tensor([r for _, _, r in picks], device=raw.device)
        chosen = torch.tensor([tokens[s][t] for s, t, _ in picks], device=raw.device)
        ks = [batch.logprobs.ks[r] for _, _, r in picks]
        entries = token_logprobs_of(token_logprob_tensors(raw[index], chosen, max(ks)), ks)
        for (seq, t, _), entry in zip(picks, entries):
            out[seq][t] = entry
        return out

    def release(self, seq_id: int) -> None:
        """Forget what the sampler keeps for a finished or aborted sequence (its
        generator). Unknown ids are ignored. Its token counts go with the cached batch
        at the next composition change."""
        self._noise.release(seq_id)

    def num_seq_generators(self) -> int:
        """Generators held for seeded sequences (a leak check: after every sequence was
        released, 0)."""
        return self._noise.num_seq_generators()

    # -- steps -----------------------------------------------------------------------------
    def _batch_for(self, seqs: list[SamplingRow], device: torch.device) -> BatchParams:
        key = batch_key(seqs, device)
        if self._batch is None or self._batch.key != key:
            self._batch = BatchParams.build(seqs, self.vocab_size, self.eos_token_ids,
                                            device, self._batch)
        return self._batch

    @staticmethod
    def _adjust(logits: torch.Tensor, batch: BatchParams) -> None:
        """Processors, allowed tokens, bad words, bias, min_tokens masks and penalties, in
        place (vLLM v1 order, its per-request processors first as in its v0)."""
        if batch.processors is not None:
            apply_logits_processors(logits, batch.processors)
        if batch.allowed is not None:
            rows, mask = batch.allowed
            logits[rows] = logits[rows].masked_fill(~mask, float("-inf"))
        if batch.bad_words is not None:
            ban_bad_words(logits, batch.bad_words)
        if batch.bias is not None:
            rows, cols, values = batch.bias
            logits.index_put_((rows, cols), values, accumulate=True)
        if batch.min_tokens is not None:
            batch.min_tokens.apply(logits)
        if batch.penalties is not None:
            batch.penalties.update()
            batch.penalties.apply(logits)

    def _choose(self, logits: torch.Tensor, batch: BatchParams) -> torch.Tensor:
        if batch.random is None:
            return row_argmax(logits)
        sampled = self._sample_random(logits, batch.random)
        if batch.greedy_rows is None:
            return sampled
        tokens = torch.empty(batch.num_rows, dtype=torch.long, device=logits.device)
        tokens[batch.greedy_rows] = row_argmax(logits[batch.greedy_rows])
        tokens[batch.random.rows] = sampled
        return tokens

    @staticmethod
    def _random_probs(logits: torch.Tensor, rnd: RandomRows) -> torch.Tensor:
        """The random rows' distributions [R, vocab]: temperature, min-p, top-k, top-p."""
        x = logits if rnd.all_rows else logits[rnd.rows]
        x.div_(rnd.temperature)
        # an extreme (valid) repetition penalty can push a logit to +inf, and softmax of
        # a row holding +inf is NaN; the largest finite value keeps that token the likeliest
        x.clamp_(max=torch.finfo(x.dtype).max)
        if rnd.log_min_p is not None:
            apply_min_p(x, rnd.log_min_p)
        x = apply_top_k_top_p(x, rnd.top_k, rnd.top_k_max, rnd.top_p)
        return x.softmax(dim=-1)

    def _sample_random(self, logits: torch.Tensor, rnd: RandomRows) -> torch.Tensor:
        probs = self._random_probs(logits, rnd)
        noise = self._noise.exponential(probs.shape[0], probs.shape[1], probs.device,
                                        rnd.seeded, rnd.unseeded)
        return row_argmax(probs.div_(noise))

