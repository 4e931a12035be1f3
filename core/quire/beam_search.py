"""The offline beam search API's types, in vLLM's shape: :class:`BeamSearchParams` in,
one :class:`BeamSearchOutput` per prompt out (``LLM.beam_search``).

The search itself runs in the engine core (:mod:`quire.engine.beam_search`); these
parameters become a ``SamplingParams`` with ``use_beam_search=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.outputs import RequestOutput, RequestOutputKind
from quire.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """How to search (vLLM's fields, plus transformers' ``early_stopping``); checked
    when turned into ``SamplingParams`` (a ``ValueError`` names the field)."""

    #: Beams kept each step; every one is returned, best first.
    beam_width: int
    #: Most tokens to generate (>= 1).
    max_tokens: int
    #: Keep searching past the end-of-sequence token.
    ignore_eos: bool = False
    #: 0 scores beams on the model's log-probabilities; > 0 divides the logits first.
    temperature: float = 0.0
    #: A finished beam scores ``sum_logprobs / generated_length ** length_penalty``.
    length_penalty: float = 1.0
    #: Accepted for vLLM's signature; beam search takes no stop strings.
    include_stop_str_in_output: bool = False
    #: True, False or "never" (transformers' meanings; docs/generation.md).
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width, best_of=self.beam_width, use_beam_search=True,
            max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's fields that apply)."""

    #: Prompt tokens, then the beam's output tokens.
    tokens: list[int]
    #: Per-token logprobs are not kept (vLLM fills them; empty here).
    logprobs: list[dict] = field(default_factory=list)
    #: The sum of the output tokens' log-probabilities.
    cum_logprob: float = 0.0
    #: The output's text.
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: ``cum_logprob / output length ** length_penalty``: what beams are ranked by.
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_output(out: RequestOutput, length_penalty: float) -> BeamSearchOutput:
    """The offline API's view of a finished beam search request."""
    seqs = []
    for c in out.outputs:
        cum = c.cumulative_logprob or 0.0
        seqs.append(BeamSearchSequence(
            tokens=list(out.prompt_token_ids) + list(c.token_ids), cum_logprob=cum,
            text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            score=cum / len(c.token_ids) ** length_penalty if c.token_ids else cum))
    return BeamSearchOutput(seqs)
