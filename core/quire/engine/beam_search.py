"""Beam search in the engine core: one :class:`BeamGroup` per request, its live beams
(each a :class:`~quire.engine.sequence.Sequence`), its finished hypotheses, and the rule
that picks the next beams, as transformers' ``_beam_search`` (5.x) defines it.

Each step a live beam's logits row becomes its top ``K`` next tokens by log-probability
(``log_softmax`` in float32 of the raw logits, divided by ``temperature`` when it is > 0;
no other processor applies: :func:`check_beam_params` refuses them). ``K = max(2, 1 +
number of EOS ids) * width``, transformers' count, so that enough candidates that do not
end remain. Once every live beam has its candidates (beams of one request may compute in
different steps: a forked beam recomputes its last partial page, a preempted one its
whole sequence), :meth:`BeamGroup.advance`:

1. takes the top ``K`` of (beam score + token logprob) over every (beam, token);
2. a candidate *ends* when its token is an EOS id or it reaches the length limit;
3. the best ``width`` candidates that do not end are the next beams;
4. candidates among the first ``width`` that end become finished hypotheses, scored
   ``sum_logprobs / (generated_length ** length_penalty)`` (the length counts the EOS),
   unless early stopping says no better one can come; the best ``width`` are kept;
5. the group is done when no running beam can beat the worst kept hypothesis (the
   heuristic of ``early_stopping``: False, True or "never"), when ``early_stopping`` is
   True and ``width`` hypotheses are kept, or when every candidate ended.

The core applies the choice (:meth:`EngineCore._advance_beams`): a beam that has one
child continues as the same sequence; each further child is a new sequence forked from it
on its full pages (shared by reference count, not copied); a beam with no child ends and
its pages go back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quire.engine.messages import BeamHypothesis
from quire.engine.sequence import Sequence
from quire.sampling_params import SamplingParams

#: transformers' score for "nothing here" (a hypothesis slot not filled yet).
_NONE = -1.0e9


@dataclass(frozen=True)
class Choice:
    """One next beam: ``parent``'s tokens, then ``token``; ``score`` its sum of logprobs."""

    parent: Sequence
    token: int
    score: float


@dataclass
class BeamGroup:
    """The beam search of one request. Owns no pages: the core forks and finishes the
    sequences it names."""

    width: int
    #: Hypotheses returned (``n`` <= ``width``).
    n: int
    #: Output length limit (the ``max_tokens`` settled against the context).
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    temperature: float
    #: Live beams, best first (transformers' running order).
    beams: list[Sequence] = field(default_factory=list)
    #: Cumulative logprob of each live beam, by seq_id (float32 values).
    scores: dict[int, float] = field(default_factory=dict)
    #: Each live beam's candidates once computed: (logprobs [K] float32, token ids [K]).
    candidates: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: Kept hypotheses, best first, at most ``width``.
    finished: list[BeamHypothesis] = field(default_factory=list)
    #: False once no running beam can beat the worst kept hypothesis (sticky).
    improvable: bool = True
    done: bool = False

    @classmethod
    def start(cls, seq: Sequence, p: SamplingParams, eos_token_ids: frozenset[int],
              max_new_tokens: int) -> BeamGroup:
        """The group of a request (parameters ``p``) whose first sequence is ``seq``."""
        group = cls(width=p.beam_width, n=p.n, max_new_tokens=max_new_tokens,
                    eos_token_ids=frozenset() if p.ignore_eos else eos_token_ids,
                    length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                    temperature=p.temperature)
        group.beams.append(seq)
        group.scores[seq.seq_id] = 0.0
        return group

    @property
    def num_candidates(self) -> int:
        """``K``: transformers keeps ``max(2, 1 + #eos) * width`` per step."""
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def take(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Record beam ``seq``'s next-token candidates from its logits row ``[vocab]`` (a
        recompute after preemption replaces them)."""
        row = logits.to(torch.float32)
        if self.temperature > 0.0:
            row = row / self.temperature
        logprobs = torch.log_softmax(row, dim=-1)
        k = min(self.num_candidates, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, k)
        self.candidates[seq.seq_id] = (values.cpu(), ids.cpu())

    @property
    def ready(self) -> bool:
        """Every live beam has its candidates: the group can advance."""
        return len(self.candidates) == len(self.beams)

    def advance(self) -> list[Choice]:
        """Choose the next beams (best first) and keep the hypotheses that ended; sets
        :attr:`done`. Call only when :attr:`ready`."""
        gen_len = self.beams[0].num_output_tokens  # every live beam has this many
        values = torch.stack([self.candidates[b.seq_id][0] for b in self.beams])
        ids = torch.stack([self.candidates[b.seq_id][1] for b in self.beams])
        scores = torch.tensor([self.scores[b.seq_id] for b in self.beams],
                              dtype=torch.float32)
        total = (values + scores[:, None]).reshape(-1)
        k = min(self.num_candidates, total.numel())
        top, flat = torch.topk(total, k)
        per_beam = values.shape[1]
        parents = [self.beams[i] for i in (flat // per_beam).tolist()]
        tokens = ids.reshape(-1)[flat].tolist()
        at_limit = gen_len + 1 >= self.max_new_tokens
        ends = [at_limit or t in self.eos_token_ids for t in tokens]
        self._keep_finished(parents, tokens, top, ends, gen_len + 1)
        choices = [Choice(parents[i], tokens[i], float(top[i]))
                   for i in range(k) if not ends[i]][: self.width]
        self.candidates.clear()
        if all(ends) or not choices:
            self.done = True
            return []
        self._check_improvable(choices[0].score, gen_len + 1)
        full = len(self.finished) == self.width
        self.done = not self.improvable or (full and self.early_stopping is True)
        return [] if self.done else choices

    def _keep_finished(self, parents: list[Sequence], tokens: list[int],
                       top: torch.Tensor, ends: list[bool], length: int) -> None:
        """Step 4: the first ``width`` candidates that end join the hypotheses, unless
        the kept ones are final (early stopping) or cannot be beaten."""
        full = len(self.finished) == self.width
        if (full and self.early_stopping is True) or not self.improvable:
            return
        normed = (top / (length ** self.length_penalty)).tolist()
        new = [BeamHypothesis(parents[i].output_token_ids + [tokens[i]], float(top[i]),
                              normed[i],
                              "stop" if tokens[i] in self.eos_token_ids else "length")
               for i in range(min(self.width, len(tokens))) if ends[i]]
        if new:
            merged = self.finished + new  # kept ones first: ties keep the older
            merged.sort(key=lambda h: -h.score)
            self.finished = merged[: self.width]

    def _check_improvable(self, best_running: float, length: int) -> None:
        """transformers' ``_check_early_stop_heuristic``: the best running beam, at the
        best length it could still reach, against the worst kept hypothesis."""
        if len(self.finished) < self.width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        best = torch.tensor(best_running, dtype=torch.float32) / (length ** self.length_penalty)
        worst = torch.tensor(self.finished[-1].score, dtype=torch.float32)
        self.improvable = self.improvable and bool(best > worst)

    def result(self) -> list[BeamHypothesis]:
        """The best ``n`` hypotheses, best first."""
        return self.finished[: self.n]

    def replace(self, choices: list[tuple[Sequence, float]]) -> None:
        """The live beams after :meth:`advance`, as the core made them (best first)."""
        self.beams = [seq for seq, _ in choices]
        self.scores = {seq.seq_id: score for seq, score in choices}


def check_beam_params(params: SamplingParams) -> None:
    """Refuse what beam search does not run: filters, penalties, stops, logprobs,
    grammars, logits processors (the beams are scored on raw log-probabilities).

    :raises ValueError: naming the field."""
    defaults = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
    for name, default in defaults.items():
        if getattr(params, name) != default:
            raise ValueError(f"{name} is not supported with use_beam_search (got "
                             f"{getattr(params, name)!r}); leave it at {default!r}")
    for name in ("logit_bias", "stop", "stop_token_ids", "logprobs", "prompt_logprobs",
                 "structured_outputs", "allowed_token_ids", "bad_words",
                 "bad_words_token_ids", "logits_processors"):
        if getattr(params, name, None) not in (None, (), [], {}):
            raise ValueError(f"{name} is not supported with use_beam_search")
    if not math.isfinite(params.length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got "
                         f"{params.length_penalty!r}")


def check_beam_fits(request_id: str, params: SamplingParams, max_kv_tokens: int,
                    block_size: int, num_blocks: int, max_num_seqs: int) -> None:
    """A beam search request must be able to hold every beam at once (beams wait for
    each other each step).

    :raises ValueError: naming the request and the limit."""
    width = params.beam_width
    if width > max_num_seqs:
        raise ValueError(f"request {request_id}: beam width {width} is more than "
                         f"max_num_seqs={max_num_seqs}")
    pages = width * -(-max_kv_tokens // block_size)
    if pages > num_blocks:
        raise ValueError(f"request {request_id}: {width} beams of up to {max_kv_tokens} "
                         f"tokens need {pages} KV pages; the pool has {num_blocks}")
