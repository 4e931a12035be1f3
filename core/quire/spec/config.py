"""``speculative_config``: what speculative decoding runs, in vLLM's shape.

``LLM(..., speculative_config={...})`` and ``--speculative-config '{...}'`` take the same
keys as vLLM's. What is built so far: ``method: "ngram"`` (prompt lookup, no second
model), a draft ``model`` (``method: "draft_model"``, implied by ``model`` alone) and an
EAGLE or EAGLE-3 head (``method: "eagle"``, ``"eagle3"``, :mod:`quire.models.eagle`) and
the target checkpoint's own multi-token-prediction layers (``method: "mtp"``, MiMo's:
:mod:`quire.models.mimo`; vLLM's older names ``mimo_mtp``, ``deepseek_mtp`` ... read as
``mtp``), all proposing greedily in the workers (:mod:`quire.executor.drafter`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Methods vLLM names, and whether Quire runs them yet.
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
BUILT = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
#: Methods whose head reads the target's hidden states, in every step.
HEAD_METHODS = ("eagle", "eagle3", "mtp")
#: The most drafts per step: the verifier's rows and the pages they need grow with it.
MAX_SPECULATIVE_TOKENS = 16
#: ``disable_by_batch_size`` when none is given: where drafts stopped paying on the cpu
#: platform (docs/bench.md, "Speculative decoding": a gain up to 32 running sequences,
#: a loss at 64). vLLM's default is never; give null for that.
DEFAULT_DISABLE_BY_BATCH_SIZE = 40
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min",
         "prompt_lookup_max", "disable_by_batch_size", "quantization", "dtype")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked on creation; every error names the field (``speculative_config.X``)."""

    method: str
    num_speculative_tokens: int
    #: n-gram lengths prompt lookup tries, longest first (vLLM's defaults: both 5, or
    #: each the other when only one is given).
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    #: A draft model's or EAGLE head's path or name (``method`` draft_model, eagle,
    #: eagle3).
    model: str | None = None
    #: No drafts in a step whose running sequences reach this many (vLLM's name); None:
    #: always speculate.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    #: The draft model's weight format (vLLM's key; the engine's ``quantization``
    #: names): None picks as for a target (a GGUF file keeps its blocks).
    quantization: str | None = None
    #: The draft model's dtype (Quire's key): None runs it at the target's.
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)},"
                             f" got {self.method!r}")
        if self.method not in BUILT:
            raise ValueError(f"speculative_config.method {self.method!r} is not built yet; "
                             f"the methods that run are: {', '.join(BUILT)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) \
                or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min})"
                             f" exceeds prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method in ("draft_model", "eagle", "eagle3") and (
                not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config.model must name the draft model or EAGLE "
                             "head (a path, a Hub repo id or a built-in name), got "
                             f"{self.model!r}")
        if self.method == "mtp" and self.model is not None:
            raise ValueError("speculative_config.model does not apply to method 'mtp' (its "
                             "layers are the target checkpoint's own)")
        if self.method == "mtp" and self.quantization is not None:
            raise ValueError("speculative_config.quantization does not apply to method "
                             "'mtp' (its layers are read as the target's are)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model does not apply to method 'ngram' "
                             "(prompt lookup runs no second model)")
        if self.method == "ngram" and (self.quantization, self.dtype) != (None, None):
            raise ValueError("speculative_config.quantization and .dtype apply to a draft "
                             "model, not to method 'ngram'")
        if self.quantization is not None:
            from quire.quantization.methods import check_method

            try:
                check_method(self.quantization)
            except ValueError as exc:
                raise ValueError(f"speculative_config.{exc}") from None
        if self.dtype is not None:
            from quire.config import parse_dtype

            try:
                parse_dtype(self.dtype)
            except ValueError as exc:
                raise ValueError(f"speculative_config.{exc}") from None
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError("speculative_config.disable_by_batch_size must be an integer "
                             f">= 1, got {d!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict, or JSON text (the CLI's flag), with vLLM's defaults.

        :raises ValueError: naming the field, an unknown key, or bad JSON.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {value!r}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(_KEYS)}")
        method = value.get("method")
        if isinstance(method, str) and method.endswith("_mtp"):  # vLLM's older names
            method = "mtp"
        if method is None:
            if value.get("model") is None:
                raise ValueError("speculative_config needs a method (ngram) or a model")
            method = "draft_model"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        elif low is None:  # a bad given value is named as given, not as the default
            low = high if isinstance(high, int) and high >= 1 else 5
        elif high is None:
            high = low if isinstance(low, int) and low >= 1 else 5
        return cls(method=method, num_speculative_tokens=value["num_speculative_tokens"],
                   prompt_lookup_min=low, prompt_lookup_max=high, model=value.get("model"),
                   disable_by_batch_size=value.get("disable_by_batch_size",
                                                   DEFAULT_DISABLE_BY_BATCH_SIZE),
                   quantization=value.get("quantization"), dtype=value.get("dtype"))
