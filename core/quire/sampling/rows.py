"""What the sampler reads of a row: its own small input type, so that sampling never
reaches into the engine's sequences.

:class:`SamplingRow` is a protocol: the engine's ``Sequence`` satisfies it as it is, so a
step passes its sequences with no copy. :class:`DraftRow` is the row speculative decoding
adds: a sequence's context extended by its first ``j`` draft tokens, which penalties and
``min_tokens`` must see as if they were already output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from quire.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """One row of logits' owner.

    ``seq_id`` names a seeded row's generator (rows with the same id draw from one
    generator, in row order). ``output_token_ids`` is read for penalties and
    ``min_tokens``; a row whose list is the very object the previous batch held is
    counted incrementally, any other row from scratch.
    """

    @property
    def seq_id(self) -> int: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class DraftRow:
    """A verification row: ``base``'s context followed by draft tokens not yet accepted."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]

    @classmethod
    def extend(cls, base: SamplingRow, drafts: Sequence[int]) -> DraftRow:
        """``base`` as if ``drafts`` had been sampled (a new output list)."""
        return cls(base.seq_id, base.params, base.prompt_token_ids,
                   [*base.output_token_ids, *drafts])
