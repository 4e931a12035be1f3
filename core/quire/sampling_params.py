"""Per-request generation parameters, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to generate for one request. Checked on creation; raises ``ValueError``.

    This release decodes greedily (``temperature=0``); the full sampler follows.
    """

    #: 0 means greedy.
    temperature: float = 0.0
    #: Most tokens to generate.
    max_tokens: int = 16
    #: Keep generating past the end-of-sequence token.
    ignore_eos: bool = False
    #: Token ids that end generation (the matched id is kept in the output).
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature != 0:
            raise ValueError(
                f"temperature={self.temperature}: only greedy decoding (temperature=0) "
                "is implemented in this release"
            )
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        ids = tuple(self.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        self.stop_token_ids = ids
