"""Request and sequence state: what the scheduler, block manager and runner share.

The scheduler owns every :class:`Sequence` (creates, moves and finishes them). The block
manager alone writes ``block_table`` and ``block_hashes``; the model runner only reads.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

from quire.multimodal.inputs import MMItem
from quire.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence being generated. Identity (not value) equality: ids are unique."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: Order of arrival; FCFS and "newest first" preemption read it. The samples of one
    #: request share their parent's arrival.
    arrival: int = 0
    #: Lower is admitted first and preempted last; ties go by arrival. Sample ``i`` of a
    #: request has the request's priority + ``i``, so many samples of one request
    #: interleave with other requests' instead of all going ahead of them.
    priority: int = 0
    #: Which of the request's ``n`` samples this is (0 for the first).
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    #: Tokens whose K/V are in the cache (computed or taken from the prefix cache).
    num_computed_tokens: int = 0
    #: Prompt tokens found in the prefix cache at the last admission (statistic).
    num_cached_tokens: int = 0
    #: Physical page ids, in order; page i holds positions [i*bs, (i+1)*bs).
    block_table: list[int] = field(default_factory=list)
    #: Chained hashes of the leading full pages (prefix caching), block_hashes[i] for page i.
    block_hashes: list[int] = field(default_factory=list)
    #: Leading pages of ``block_table`` known to be findable by their hash (the block
    #: manager's: a held page stays findable, so it is not looked at again).
    num_named_blocks: int = 0
    #: Times this sequence lost its pages to preemption.
    num_preemptions: int = 0
    #: ``time.monotonic()`` when the scheduler first admitted it (statistic).
    first_scheduled_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Tokens sampled on the device and not yet on the host (0 or 1; async scheduling):
    #: the scheduler counts them as known, so the next step can compute them.
    num_pending_tokens: int = 0
    #: The longest the sequence may grow (prompt + output limit): a token that reaches it
    #: ends it by length. The scheduler never schedules a pending token that will.
    max_num_tokens: int = sys.maxsize
    #: Draft tokens proposed for the next step (speculative decoding). They are not the
    #: sequence's tokens: the step computes them after its own, and the tokens the
    #: verifier accepts are appended to ``output_token_ids`` like sampled ones.
    spec_token_ids: list[int] = field(default_factory=list)
    #: With a draft model or an EAGLE head: positions, from the first, whose draft K/V
    #: is in the pages (-1: not known yet; :class:`~quire.engine.speculation.DraftKV`
    #: keeps it). Steps that run the drafter carry the tokens from here on
    #: (``StepItem.draft_lag``).
    draft_computed: int = -1
    #: The LoRA adapter it runs with (0: the base model) and where it is.
    lora_id: int = 0
    lora_path: str = ""
    #: The prompt's images (an image-text model), in prompt order.
    mm_items: list[MMItem] = field(default_factory=list)

    @property
    def order(self) -> tuple[int, int]:
        """The scheduler's sort key: (priority, arrival)."""
        return self.priority, self.arrival

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the output so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the scheduler counts: those on the host and those pending."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) \
            + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known or pending tokens whose K/V are not yet in the cache (1 for a decoding
        sequence)."""
        return self.num_tokens_with_pending - self.num_computed_tokens

    @property
    def pending_finishes_it(self) -> bool:
        """A pending token that will surely end the sequence by length (so the next step
        has nothing to compute for it)."""
        return self.num_pending_tokens > 0 and self.num_tokens_with_pending >= self.max_num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
