"""Per-request generation parameters, with vLLM's names and meanings.

``SamplingParams`` is checked when created and normalised in place (it is a plain,
mutable dataclass on purpose: normalising needs no ``object.__setattr__`` tricks). Checks
that need engine facts (vocabulary size, the logprobs cap) live in
:meth:`SamplingParams.check_against`, which the engine calls when a request arrives.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quire.outputs import RequestOutputKind
from quire.structured.params import KINDS, StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Temperatures in (0, MIN_TEMPERATURE) are raised to it, as vLLM does: below it the
#: distribution is greedy in all but name and float32 logits/temperature overflows.
MIN_TEMPERATURE = 0.01
#: ``logit_bias`` values must lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range).
LOGIT_BIAS_LIMIT = 100.0
#: The engine's default cap on ``logprobs`` / ``prompt_logprobs`` (vLLM's ``max_logprobs``).
DEFAULT_MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes a 64-bit value; child seeds are seed + index.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
#: The sampler computes in float32: its largest finite value and smallest normal one.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
#: Integer fields whose value has no useful meaning past this (they become int64 tensors
#: or counts of tokens); larger values are refused rather than overflow.
INT64_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    """How to generate for one request. Checked on creation; raises ``ValueError``
    naming the field and its allowed range.

    Follows vLLM's ``SamplingParams`` (names, defaults, ranges). Where OpenAI's API or
    older vLLM differ, the choice made here:

    * ``temperature`` defaults to 1.0 (vLLM and OpenAI); 0 means greedy, and then
      ``top_p``/``top_k``/``min_p`` are reset to "off" and ``n`` must be 1 (vLLM).
      Values in (0, 0.01) are raised to 0.01 with a warning (vLLM). Range [0, 2]
      (current vLLM and OpenAI; older vLLM releases accepted any value >= 0).
    * ``top_p`` in (0, 1.18e-38) (float32's smallest normal value) is raised to it:
      in the sampler's float32 it would be 0, which keeps nothing; at that value only the
      most likely token is kept, i.e. the choice is greedy.
    * ``repetition_penalty`` must be in float32's normal range [1.18e-38, 3.4e38], so
      that it is neither 0 nor infinite where the sampler uses it.
    * ``top_k``: 0 or -1 both mean off (vLLM accepts both); stored as 0.
    * ``seed``: -1 means no seed (vLLM). Sequence ``i`` of a seeded request with
      ``n > 1`` samples with seed ``seed + i`` (vLLM's parallel sampling), see
      :meth:`for_sequence`.
    * ``repetition_penalty`` (vLLM/HF style): applies to tokens of the prompt *and* the
      output; positive logits are divided by it, negative ones multiplied.
      ``presence_penalty``/``frequency_penalty`` (OpenAI style) subtract, and count
      output tokens only.
    * ``logit_bias``: keys are token ids (ints; OpenAI's string keys are the API
      layer's job to convert), values must be in [-100, 100] -- out-of-range values
      raise, where vLLM's OpenAI layer clamps them.
    * ``max_tokens=None`` means "up to the context length"
      (see :meth:`max_output_tokens`), as in vLLM.
    * ``min_tokens``: until that many tokens are out, EOS and ``stop_token_ids`` cannot
      be sampled (masked in the sampler), even with ``ignore_eos`` (vLLM).
    * ``logprobs``/``prompt_logprobs``: ``None`` (none), ``k >= 0`` (the chosen token
      plus the top ``k``), or -1 (the whole vocabulary; vLLM). Booleans are refused
      (vLLM maps ``True`` to 1). Logprobs are of the model's raw distribution, before
      penalties, bias and temperature (vLLM v1's default ``raw_logprobs``).
    * ``stop``/``stop_token_ids`` are normalised to tuples (duplicates dropped, order
      kept); ``stop`` strings must be non-empty.
    * ``allowed_token_ids``: only these tokens can be sampled (vLLM); a non-empty list.
    * ``bad_words``: strings whose tokens must not be generated (vLLM): the engine's
      front turns each into token sequences, with and without a leading space
      (``bad_words_token_ids``), and the sampler bans a sequence's last token whenever the
      output ends with the rest of it. A user may give ``bad_words_token_ids`` directly.
    * ``logits_processors`` (offline only; vLLM's per-request processors): callables
      ``f(output_ids, logits)`` or ``f(prompt_ids, output_ids, logits)`` returning the
      float32 ``[vocab]`` row to sample from, applied first, in order. They run in the
      engine core's process, so they need the core in the caller's process.
      Logprobs stay raw, from before every processor.

    Do not change a ``SamplingParams`` after its request was added: the sampler caches
    tensors built from it for as long as the batch does not change.
    """

    #: Number of output sequences for the prompt.
    n: int = 1
    #: Subtracted once from the logit of every token already in the output; [-2, 2].
    presence_penalty: float = 0.0
    #: Subtracted per occurrence in the output so far; [-2, 2].
    frequency_penalty: float = 0.0
    #: > 0; 1 is off. Tokens in the prompt or output: positive logits / p, negative * p.
    repetition_penalty: float = 1.0
    #: [0, 2]; 0 means greedy.
    temperature: float = 1.0
    #: (0, 1]; smallest set of top tokens whose probability reaches top_p. 1 is off.
    top_p: float = 1.0
    #: Keep the k most likely tokens (ties at the k-th value kept too); 0 (or -1) is off.
    top_k: int = 0
    #: [0, 1]; drop tokens less likely than min_p times the most likely one. 0 is off.
    min_p: float = 0.0
    #: Per-request random seed; None (or -1) draws from the engine's generator.
    seed: int | None = None
    #: Strings that end generation (the engine matches them in the decoded text).
    stop: str | Sequence[str] | None = None
    #: Token ids that end generation (the matched id is kept in the output).
    stop_token_ids: Sequence[int] | None = None
    #: Keep a matched stop string in the output text.
    include_stop_str_in_output: bool = False
    #: Keep generating past the end-of-sequence token.
    ignore_eos: bool = False
    #: Most tokens to generate (>= 1), or None for up to the context length.
    max_tokens: int | None = 16
    #: Fewest tokens to generate before EOS / stop_token_ids may be sampled.
    min_tokens: int = 0
    #: None, k >= 0 (chosen token plus top k per output token), or -1 (whole vocab).
    logprobs: int | None = None
    #: Like ``logprobs``, per prompt token.
    prompt_logprobs: int | None = None
    #: Leave special tokens out of the decoded text.
    skip_special_tokens: bool = True
    #: Put spaces between special tokens in the decoded text.
    spaces_between_special_tokens: bool = True
    #: Token id -> value added to its logit, in [-100, 100].
    logit_bias: Mapping[int, float] | None = field(default=None)
    #: What each output of a running request carries: everything so far, only what is
    #: new (streams), or nothing until it finishes.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: A grammar the output must follow (JSON schema, regex, choice, grammar, any JSON
    #: object); a dict is read as :class:`StructuredOutputsParams`' fields.
    structured_outputs: StructuredOutputsParams | None = None
    #: Only these token ids may be sampled; None allows all.
    allowed_token_ids: Sequence[int] | None = None
    #: Words the output must not contain, as the tokenizer splits them.
    bad_words: Sequence[str] | None = None
    #: ``bad_words`` as token sequences: set by the engine's front from ``bad_words``
    #: (or given directly); the sampler reads only this.
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    #: Per-request logits processors (callables, see above; never crosses a process).
    logits_processors: Sequence[Any] | None = None
    #: Beam search instead of sampling (vLLM's extra parameter): the best ``n`` of
    #: ``best_of`` (or ``n``) beams, see ``docs/generation.md``.
    use_beam_search: bool = False
    #: Beam width with ``use_beam_search`` (None: ``n``); without it, samples drawn, of
    #: which the ``n`` with the highest cumulative logprob are returned (vLLM's).
    best_of: int | None = None
    #: Beam search: a finished beam scores ``sum_logprobs / length ** length_penalty``.
    length_penalty: float = 1.0
    #: Beam search: True, False or "never" (transformers' meanings).
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1)
        self._check_penalties()
        self._check_vocabulary_limits()
        self._check_temperature_and_filters()
        self._check_lengths()
        self._check_stops()
        self._check_outputs()
        self._check_beam_search()

    # -- checks, one group each ------------------------------------------------------------
    def _check_penalties(self) -> None:
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty,
                                        -2.0, 2.0)
        rp = _float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY,
                    FLOAT32_MAX, "(0, inf) and within float32's normal range "
                    "[1.18e-38, 3.4e38]")
        self.repetition_penalty = rp
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    def _check_vocabulary_limits(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            ids = _token_ids("allowed_token_ids", allowed)
            if not ids:
                raise ValueError("allowed_token_ids must hold at least one token id (None "
                                 "allows every token)")
            self.allowed_token_ids = tuple(dict.fromkeys(ids))
        words = self.bad_words
        if words is not None:
            strings = (words,) if isinstance(words, str) else tuple(words)
            if not all(isinstance(w, str) and w.strip() for w in strings):
                raise ValueError(f"bad_words must be a list of non-blank strings, "
                                 f"got {words!r}")
            self.bad_words = tuple(dict.fromkeys(strings)) or None
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
                raise ValueError(f"bad_words_token_ids must be a list of token id lists, "
                                 f"got {seqs!r}")
            checked = [_token_ids("bad_words_token_ids", s) for s in seqs]
            if not all(checked):
                raise ValueError("bad_words_token_ids must not hold an empty list")
            self.bad_words_token_ids = tuple(dict.fromkeys(checked)) or None
        procs = self.logits_processors
        if procs is not None:
            procs = tuple(procs) if not callable(procs) else (procs,)
            for proc in procs:
                logits_processor_arity(proc)  # raises naming the field
            self.logits_processors = procs or None

    def _check_temperature_and_filters(self) -> None:
        t = _float("temperature", self.temperature, 0.0, 2.0)
        if 0.0 < t < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g; using %g", t, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)
            t = MIN_TEMPERATURE
        self.temperature = t
        self.top_p = max(_float("top_p", self.top_p, 0.0, 1.0, "(0, 1]", lo_open=True),
                         FLOAT32_TINY)
        top_k = self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not -1 <= top_k <= INT64_MAX:
            raise ValueError(f"top_k must be 0 or -1 (off) or an integer >= 1, got {top_k!r}")
        self.top_k = max(top_k, 0)
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, _SEED_MIN, _SEED_MAX)
            if self.seed == -1:
                self.seed = None
        if t == 0.0:  # greedy: the filters cannot change an argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1 and not self.use_beam_search:
                raise ValueError(f"n must be 1 when sampling greedily (temperature=0), "
                                 f"got {self.n}")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, INT64_MAX)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            self.stop = ()
        else:
            strings = (stop,) if isinstance(stop, str) else tuple(stop)
            if not all(isinstance(s, str) and s for s in strings):
                raise ValueError(f"stop must be a non-empty string or a list of non-empty "
                                 f"strings, got {stop!r}")
            self.stop = tuple(dict.fromkeys(strings))
        ids = self.stop_token_ids
        if not ids:
            self.stop_token_ids = ()
        else:
            ids = tuple(ids) if not isinstance(ids, tuple) else ids
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
                   for t in ids):
                raise ValueError(f"stop_token_ids must be token ids (integers >= 0), "
                                 f"got {ids!r}")
            self.stop_token_ids = tuple(dict.fromkeys(ids))

    def _check_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not -1 <= value <= INT64_MAX):
                raise ValueError(f"{name} must be None, an integer >= 0, or -1 (whole "
                                 f"vocabulary), got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        so = self.structured_outputs
        if isinstance(so, Mapping):
            unknown = sorted(set(so) - set(KINDS))
            if unknown:
                raise ValueError(f"structured_outputs has no field {unknown[0]!r}; "
                                 f"known: {', '.join(KINDS)}")
            self.structured_outputs = StructuredOutputsParams(**so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a "
                             f"dict, got {type(so).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}")

    def _check_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be True or False, got "
                             f"{self.use_beam_search!r}")
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of, lo=self.n)
            if not self.use_beam_search and self.best_of > 1 and self.temperature == 0.0:
                raise ValueError(f"best_of must be 1 when sampling greedily "
                                 f"(temperature=0), got {self.best_of}")
        self.length_penalty = _float("length_penalty", self.length_penalty,
                                     -FLOAT32_MAX, FLOAT32_MAX, "[-3.4e38, 3.4e38]")
        if self.early_stopping not in (True, False, "never") \
                or isinstance(self.early_stopping, (int, float)) \
                and not isinstance(self.early_stopping, bool):
            raise ValueError(f"early_stopping must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        # what else beam search refuses, the engine checks (engine/beam_search.py)

    def best_of_samples(self) -> SamplingParams:
        """What the engine runs for sampling with ``best_of > n``: ``best_of`` samples,
        each token's logprob kept (``logprobs`` at least 0), of which the front returns
        the ``n`` with the highest cumulative logprob, once, at the end (a stream gets
        them in one final output); ``self`` when nothing is picked."""
        if self.use_beam_search or self.best_of is None or self.best_of == self.n:
            return self
        run = copy.copy(self)
        run.n, run.best_of = self.best_of, None
        if run.logprobs is None:
            run.logprobs = 0
        return run

    @property
    def beam_width(self) -> int:
        """Beams kept per step with ``use_beam_search``: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    # -- what the engine asks --------------------------------------------------------------
    def check_against(self, *, vocab_size: int,
                      max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """Checks that need the engine's facts; the engine calls it when adding a request.

        :param vocab_size: width of the model's logits.
        :param max_logprobs: the engine's cap on ``logprobs``/``prompt_logprobs``; -1
            means the whole vocabulary is allowed.
        :raises ValueError: a token id in ``logit_bias``, ``stop_token_ids``,
            ``allowed_token_ids`` or ``bad_words_token_ids`` outside ``[0, vocab_size)``,
            or more logprobs than ``max_logprobs``.
        """
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            wanted = vocab_size if value == -1 else value
            if wanted is not None and wanted > cap:
                whole = f" (-1 asks for all {vocab_size})" if value == -1 else ""
                raise ValueError(f"{name} must be in [0, max_logprobs={cap}], got "
                                 f"{value}{whole}")
        bad_words = [t for seq in self.bad_words_token_ids or () for t in seq]
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("stop_token_ids", self.stop_token_ids or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words_token_ids", bad_words)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}) (the "
                                 f"vocabulary), got {bad[0]}")

    def max_output_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The output length limit: ``max_tokens``, or what is left of the context when
        ``max_tokens`` is None (never more than what is left)."""
        room = max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def for_sequence(self, index: int) -> SamplingParams:
        """The parameters of output sequence ``index`` (0 <= index < n): ``n=1``, and a
        seeded request's seed becomes ``seed + index`` (vLLM's parallel sampling), so
        the sequences of one request differ while each stays reproducible.

        Returns a shallow copy without re-checking (``self`` is already valid); for
        ``n == 1`` it returns ``self``.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, n={self.n}), got {index}")
        if self.n == 1:
            return self
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child


def _int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo \
            or (hi is not None and value > hi):
        if hi is None or (hi == INT64_MAX and lo >= 0):  # int64 goes without saying
            allowed = f">= {lo}" + (" (within int64)" if isinstance(value, int) and
                                    hi is not None and value > hi else "")
        else:
            allowed = f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return value


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
           for t in ids):
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {list(ids)!r}")
    return tuple(ids)


def logits_processor_arity(proc: object) -> int:
    """How many arguments a logits processor takes: 2 (output ids, logits) or 3 (prompt
    ids, output ids, logits), as vLLM's per-request processors.

    :raises ValueError: not a callable of two or three positional arguments."""
    if not callable(proc):
        raise ValueError(f"logits_processors must hold callables, got {proc!r}")
    try:
        params = inspect.signature(proc).parameters.values()
    except (TypeError, ValueError):
        raise ValueError(f"logits_processors: cannot read the signature of {proc!r}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if len(positional) not in (2, 3):
        raise ValueError(f"logits_processors take (output_ids, logits) or (prompt_ids, "
                         f"output_ids, logits), got {proc!r} with {len(positional)} "
                         f"required arguments")
    return len(positional)


def _float(name: str, value: object, lo: float, hi: float, shown: str | None = None, *,
           lo_open: bool = False, hi_open: bool = False) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)  # an int past float's range (JSON allows 1e400 as int)
        except OverflowError:
            value = math.inf if value > 0 else -math.inf
        # Comparisons are False for NaN, so NaN is refused too.
        above = value > lo if lo_open else value >= lo
        below = value < hi if hi_open else value <= hi
        if above and below:
            return float(value)
    shown = shown or f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    raise ValueError(f"{name} must be in {shown}, got {value!r}")


def _logit_bias(bias: Mapping[int, float]) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), "
                             f"got {token!r}")
        out[token] = _float(f"logit_bias[{token}]", value, -LOGIT_BIAS_LIMIT,
                            LOGIT_BIAS_LIMIT)
    return out
