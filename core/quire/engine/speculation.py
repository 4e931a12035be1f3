"""The engine's side of speculative decoding: drafts for the next step, and the counts of
what the verifier accepted.

After each step the core hands the sequences that got tokens to :class:`Speculator`,
which sets each one's ``spec_token_ids``: the proposer's drafts (n-gram prompt lookup),
or with a draft model as many stand-ins (:data:`DRAFT_STAND_IN`), which the workers'
drafter replaces before the target's forward; cut so that the sequence can never
outgrow its length limit, to what its grammar allows (n-gram drafts), and to nothing
when the running batch reaches ``disable_by_batch_size`` (a large batch is bound by
compute, not by streaming weights, so verifying drafts costs more than it saves). The
scheduler runs the drafts after the sequence's last token in the same forward, and the
sampler's :meth:`~quire.sampler.Sampler.verify` keeps those the target accepts.

A draft model's K/V is written only in steps that draft, so a sequence that sat some
out must first catch up (a second prefill, for a draft as dear as its target). Two
rules keep that from costing more than drafting saves: a sequence first stepped while
sequences wait for room and the running and waiting ones reach
``disable_by_batch_size`` never drafts (vLLM's rule for new requests under load), and
one whose draft has more tokens to catch up than the sequence has left to produce (and
more than the lag of a step that drafted) stops drafting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from quire.engine.scheduler import ScheduledSeq
from quire.engine.sequence import Sequence
from quire.spec.config import HEAD_METHODS, SpeculativeConfig
from quire.spec.ngram import NgramProposer
from quire.structured.backend import Matcher

#: The value of a draft the workers' draft model has yet to propose (any valid id: the
#: scheduler only counts drafts, and the drafter overwrites it).
DRAFT_STAND_IN = 0


@dataclass
class SpecStats:
    """Counters since the core started (vLLM's ``spec_decode`` metrics)."""

    #: Verifications of at least one draft.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: Drafts accepted at position i (0-based) of their proposal.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        for pos in range(accepted):
            per_pos[pos] += 1


class TokenArrays:
    """Each live sequence's tokens as an int32 array that grows as tokens come (a
    sequence's tokens are never taken back, preemption included), so that a proposal
    reads its tokens without copying the whole list every step."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def of(self, seq: Sequence) -> np.ndarray:
        """``seq``'s tokens, prompt then output (a view, valid until the next call)."""
        total = seq.num_tokens
        array, known = self._arrays.get(seq.seq_id, (None, 0))
        if array is None or total > len(array):
            grown = np.empty(max(64, 2 * total), dtype=np.int32)
            if array is None:
                known = seq.num_prompt_tokens
                grown[:known] = seq.prompt_token_ids
            else:
                grown[:known] = array[:known]
            array = grown
        if total > known:
            n_prompt = seq.num_prompt_tokens
            array[known:total] = seq.output_token_ids[known - n_prompt : total - n_prompt]
        self._arrays[seq.seq_id] = (array, total)
        return array[:total]

    def forget(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._arrays)


class DraftKV:
    """Where the draft's K/V stands for each sequence (``Sequence.draft_computed``),
    with a draft model or an EAGLE (or MTP) head; one per engine core.

    - A draft model runs only in steps that draft, over every item's tokens its K/V
      lacks: it writes its K/V for the known tokens and for its proposals but the last.
      Pages from the prefix cache or a forked parent may have been computed in steps
      without it, so they are not trusted: a sequence starts at 0.
    - An EAGLE or MTP head runs in every step: it writes position ``i`` from the target's
      hidden state at ``i``, which the workers keep only from the step before, so each
      step writes the positions the last one computed, up to the item's start. It writes
      its proposals' positions from its own hidden states, so they do not count. Pages
      from the prefix cache were written with them when computed: trusted.
    """

    def __init__(self, every_step: bool) -> None:
        self.every_step = every_step

    def runs(self, scheduled: Iterable[ScheduledSeq]) -> bool:
        """Whether the drafter runs in a step of these items."""
        return self.every_step or any(s.spec for s in scheduled)

    def lag(self, seq: Sequence, start: int) -> list[int]:
        """The tokens before ``start`` whose draft K/V is missing."""
        done = seq.draft_computed
        if done < 0:  # new, or preempted
            done = seq.draft_computed = start if self.every_step else 0
        return seq.token_slice(done, start) if done < start else []

    def settle(self, scheduled: list[ScheduledSeq]) -> None:
        """After a step: how far each sequence's draft K/V now reaches."""
        if not self.runs(scheduled):
            return
        for s in scheduled:
            seq = s.seq
            if seq.is_finished:
                continue
            if self.every_step:
                seq.draft_computed = s.start
            else:  # the known tokens', and the proposals' but the last
                seq.draft_computed = s.end - 1 if s.spec else s.end


class Speculator:
    """Proposes drafts for sequences; one per engine core. Call :meth:`forget` when a
    sequence finishes."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        #: None with a draft model: its proposals are made in the workers.
        self.proposer = NgramProposer(config.num_speculative_tokens,
                                      config.prompt_lookup_min, config.prompt_lookup_max
                                      ) if config.method == "ngram" else None
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.tokens = TokenArrays()
        #: The draft's K/V per sequence, with a draft model or an EAGLE head.
        self.draft_kv: DraftKV | None = (None if config.method == "ngram"
                                         else DraftKV(every_step=config.method
                                                      in HEAD_METHODS))

        #: With a draft model: sequences that draft (True) or never will (False), decided
        #: at their first proposal and when they would catch up (module docstring).
        self._drafting: dict[int, bool] = {}

    def forget(self, seq_id: int) -> None:
        """Drop what is kept for a finished or aborted sequence."""
        self.tokens.forget(seq_id)
        self._drafting.pop(seq_id, None)

    def _may_draft(self, seq: Sequence, room: int, num_running: int,
                   num_waiting: int) -> bool:
        """A draft model's rules for one sequence (module docstring); True for the
        other methods, whose drafts need no catching up."""
        kv = self.draft_kv
        if kv is None or kv.every_step:
            return True
        limit = self.config.disable_by_batch_size
        may = self._drafting.get(seq.seq_id)
        if may is None:
            loaded = limit is not None and num_waiting > 0 \
                and num_running + num_waiting >= limit
            may = self._drafting[seq.seq_id] = not loaded
        elif may and (seq.draft_computed > 0 or len(seq.output_token_ids) > 1):
            # it drafted before, or sat out a step since its first token
            lag = seq.num_tokens - max(seq.draft_computed, 0)
            if lag > max(room, self.config.num_speculative_tokens + 1):
                may = self._drafting[seq.seq_id] = False
        return may

    def propose(self, seqs: list[Sequence], num_running: int,
                matchers: dict[int, Matcher], thinking: set[int],
                num_waiting: int = 0) -> None:
        """Set ``spec_token_ids`` of each unfinished sequence of ``seqs``.

        :param matchers: seq_id -> its grammar's matcher; drafts are cut to the tokens it
            allows.
        :param thinking: seq_ids whose grammar waits for the end of their thinking: they
            get no drafts (which of their drafts the grammar holds is not known ahead).
        A draft model's stand-ins are not cut to the grammar (their values are not known
        here): the core cuts its proposals before verifying them.
        :param num_waiting: sequences waiting to be scheduled (with ``num_running``, the
            load a draft model's rules read).
        """
        limit = self.config.disable_by_batch_size
        off = limit is not None and num_running >= limit
        for seq in seqs:
            if seq.is_finished:
                continue
            # the step computes the drafts and samples one more token: k + 1 may be added
            room = seq.max_num_tokens - seq.num_tokens - 1
            if (not self._may_draft(seq, room, num_running, num_waiting) or off
                    or room <= 0 or seq.seq_id in thinking):
                seq.spec_token_ids = []
                continue
            if self.proposer is None:
                seq.spec_token_ids = [DRAFT_STAND_IN] * min(room,
                                                            self.config.num_speculative_tokens)
                continue
            drafts = self.proposer.propose(self.tokens.of(seq), room)
            if drafts and matchers:
                matcher = matchers.get(seq.seq_id)
                if matcher is not None:
                    drafts = drafts[: matcher.num_valid(drafts)]
            seq.spec_token_ids = drafts
