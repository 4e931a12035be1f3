"""Benchmark workloads: the named presets W1..W7 and the requests they expand to.

A :class:`WorkloadSpec` says how many requests, which prompt and output lengths (fixed or
a range drawn from a seed), and whether they share a system prompt. :func:`build_requests`
turns it into concrete prompts cut from the corpus. Everything is drawn from one seeded
generator, so the same spec, tokenizer and repeat index always give the same token ids.

Each repeat of a measurement uses its own draw (``repeat=0, 1, ...``): the same lengths
and shape, different text. A second run of the very same prompts would otherwise be
served from a prefix cache and measure the cache instead of the engine.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from quire.bench.corpus import Corpus, Prompt

# Prompts must differ within this many tokens after any shared part, so that no two
# requests share a KV page by accident (pages hold 8 tokens or more).
DISTINCT_HEAD = 4
# Offsets tried per request before the corpus is declared too small for the workload.
_MAX_OFFSET_TRIES = 2000
# Room past a slice's nominal end for the round-trip adjustments of Corpus.prompt.
_MAX_SLACK = 16


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of a workload. Ranges are inclusive; (n, n) is a fixed length."""

    name: str
    description: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    #: Tokens of a system prompt every request starts with (special tokens included);
    #: ``input_len`` then counts the distinct tail after it.
    shared_prefix_len: int = 0
    #: Concurrent clients for ``quire bench serve`` (None: one per request).
    concurrency: int | None = None
    seed: int = 0
    #: Tokens of each prompt's own start repeated after it (a model asked to quote or
    #: edit its input, which n-gram speculation serves); ``input_len`` counts the
    #: passage before them.
    quote_len: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for field in ("input_len", "output_len"):
            lo, hi = getattr(self, field)
            if not 1 <= lo <= hi:
                raise ValueError(f"{field} must be a range 1 <= lo <= hi, got ({lo}, {hi})")
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 <= self.quote_len < self.input_len[0]:
            raise ValueError(f"quote_len must be in [0, {self.input_len[0]}), got "
                             f"{self.quote_len}")

    @property
    def max_prompt_len(self) -> int:
        return self.shared_prefix_len + self.input_len[1] + self.quote_len

    @property
    def max_total_len(self) -> int:
        """The longest a sequence of this workload can get (prompt + output)."""
        return self.max_prompt_len + self.output_len[1]

    def with_overrides(self, num_requests: int | None = None, input_len: int | None = None,
                       output_len: int | None = None) -> WorkloadSpec:
        """This spec with fixed values where given (``--num-requests`` and friends)."""
        changes: dict[str, Any] = {}
        if num_requests is not None:
            changes["num_requests"] = num_requests
        if input_len is not None:
            changes["input_len"] = (input_len, input_len)
        if output_len is not None:
            changes["output_len"] = (output_len, output_len)
        if not changes:
            return self
        custom = dataclasses.replace(self, **changes)
        return dataclasses.replace(custom, name=f"{self.name}+custom",
                                   description=f"from {self.name}: {custom.shape()}")

    def shape(self) -> str:
        """The numbers of the spec in words."""
        def span(lo: int, hi: int) -> str:
            return str(lo) if lo == hi else f"{lo}-{hi}"

        prefix = f"a {self.shared_prefix_len}-token shared prefix + " \
            if self.shared_prefix_len else ""
        quote = f" + their first {self.quote_len} again" if self.quote_len else ""
        return (f"{self.num_requests} requests, prompts {prefix}{span(*self.input_len)}"
                f"{quote}, outputs {span(*self.output_len)}")


PRESETS: dict[str, WorkloadSpec] = {
    w.name: w for w in (
        WorkloadSpec("W1", "offline batch: 64 x 128 prompt tokens, 128 output tokens",
                     num_requests=64, input_len=(128, 128), output_len=(128, 128), seed=1),
        WorkloadSpec("W2", "single stream: 128 in, 128 out",
                     num_requests=1, input_len=(128, 128), output_len=(128, 128), seed=2),
        WorkloadSpec("W3", "mixed: 32 requests, prompts 16-1024, outputs 16-256",
                     num_requests=32, input_len=(16, 1024), output_len=(16, 256), seed=3),
        WorkloadSpec("W4", "shared prefix: 64 requests, 512-token system prompt, "
                     "64-token tails, 64 output tokens",
                     num_requests=64, input_len=(64, 64), output_len=(64, 64),
                     shared_prefix_len=512, seed=4),
        WorkloadSpec("W5", "serving: 240 requests from 120 concurrent clients, "
                     "prompts 16-1024, outputs 16-256",
                     num_requests=240, input_len=(16, 1024), output_len=(16, 256),
                     concurrency=120, seed=5),
        WorkloadSpec("W6", "quoting: single stream, a 128-token passage then its first 64 "
                     "tokens again, 128 out (n-gram speculation's case)",
                     num_requests=1, input_len=(128, 128), output_len=(128, 128),
                     quote_len=64, seed=6),
        WorkloadSpec("W7", "A/B: 120 requests from 60 concurrent clients over two models "
                     "(two --served-model-name, or two --url), prompts 16-256, outputs "
                     "100-300 (mean 200)",
                     num_requests=120, input_len=(16, 256), output_len=(100, 300),
                     concurrency=60, seed=7),
    )
}


def preset(name: str) -> WorkloadSpec:
    """:raises ValueError: naming the presets, for an unknown name."""
    try:
        return PRESETS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt (text and ids) and how many tokens to make."""

    prompt: Prompt
    output_len: int

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.prompt.token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)


def build_requests(spec: WorkloadSpec, corpus: Corpus, repeat: int = 0) -> list[BenchRequest]:
    """The requests of ``spec`` for repeat number ``repeat``, deterministically.

    :raises ValueError: when the corpus is too short for the longest prompt, or too
        repetitive to give every request a distinct start.
    """
    rng = random.Random(spec.seed * 1_000_003 + repeat)
    lengths = [(rng.randint(*spec.input_len), rng.randint(*spec.output_len))
               for _ in range(spec.num_requests)]
    lead = None
    if spec.shared_prefix_len:
        lead, _ = _draw_prompt(corpus, rng, spec.shared_prefix_len, None, set(), spec.name)
    heads: set[tuple[int, ...]] = set()
    requests = []
    for input_len, output_len in lengths:
        total = input_len + (spec.shared_prefix_len if lead else 0)
        prompt, start = _draw_prompt(corpus, rng, total, lead, heads, spec.name)
        if spec.quote_len:
            quoted = corpus.prompt(start, total + spec.quote_len, prompt)
            if quoted is None:
                raise ValueError(f"workload {spec.name}: the passage at corpus token {start} "
                                 f"cannot be quoted to exactly {spec.quote_len} tokens")
            prompt = quoted
        requests.append(BenchRequest(prompt, output_len))
    return requests


def _draw_prompt(corpus: Corpus, rng: random.Random, num_tokens: int, lead: Prompt | None,
                 heads: set[tuple[int, ...]], name: str) -> tuple[Prompt, int]:
    """A prompt at a random offset whose first tokens after the shared part are new, and
    the corpus token its text starts at."""
    fixed = len(lead.token_ids) if lead else corpus.num_special
    last_start = len(corpus) - (num_tokens - fixed) - _MAX_SLACK
    if last_start < 0:
        raise ValueError(f"workload {name}: a {num_tokens}-token prompt is longer than the "
                         f"benchmark corpus ({len(corpus)} tokens)")
    for _ in range(_MAX_OFFSET_TRIES):
        start = rng.randint(0, last_start)
        prompt = corpus.prompt(start, num_tokens, lead)
        if prompt is None:
            continue
        head = prompt.token_ids[fixed:fixed + DISTINCT_HEAD]
        if head not in heads:
            heads.add(head)
            return prompt, start
    raise ValueError(f"workload {name}: could not find distinct {num_tokens}-token prompts in "
                     f"the corpus after {_MAX_OFFSET_TRIES} tries; ask for fewer or longer ones")
