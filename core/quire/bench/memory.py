"""KV memory: paged allocation against contiguous reservation, simulated without a model.

Every request of a workload arrives at once; each step, every running sequence writes
its newest token's K/V and samples another, and waiting requests are admitted in order
while memory allows. The policies differ only in what admission and growth take:

==========================  ===================================================  ============
policy                      memory a sequence holds                              when full
==========================  ===================================================  ============
paged                       pages of ``block_size`` tokens, added as it grows;   preempt the
                            full prompt pages shared by prefix (our real          newest
                            ``BlockManager``)                                     sequence
contiguous (max_model_len)  ``max_model_len`` tokens from admission to the end   wait
contiguous (prompt+max)     ``prompt + max_tokens`` tokens, likewise             wait
==========================  ===================================================  ============

Waste is memory held but holding no token: for paged, the unfilled tail of each
sequence's last page; for contiguous, everything reserved beyond the tokens written so
far. It is reported as a share of the memory held, summed over all steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quire.bench.workloads import BenchRequest
from quire.engine.block_manager import BlockManager
from quire.engine.sequence import Sequence
from quire.sampling_params import SamplingParams

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_TOKEN_SUFFIXES = ("tokens", "token", "tok")


@dataclass(frozen=True)
class KVBudget:
    """A KV memory budget: a number of tokens, or bytes to convert with the model's size."""

    tokens: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.bytes is None):
            raise ValueError("a KV budget is either tokens or bytes")
        value = self.tokens if self.tokens is not None else self.bytes
        if value is None or value < 1:
            raise ValueError(f"a KV budget must be >= 1, got {value}")

    @classmethod
    def parse(cls, text: str) -> KVBudget:
        """``8192tok`` / ``8192 tokens`` (tokens), ``2GiB`` / ``500MB`` / ``1000000`` (bytes).

        :raises ValueError: naming the accepted forms.
        """
        lowered = text.strip().lower().replace(" ", "")
        try:
            for suffix in _TOKEN_SUFFIXES:
                if lowered.endswith(suffix):
                    return cls(tokens=int(lowered[: -len(suffix)]))
            for suffix, scale in _UNITS.items():
                if lowered.endswith(suffix):
                    return cls(bytes=int(float(lowered[: -len(suffix)]) * scale))
            return cls(bytes=int(lowered))
        except ValueError as exc:
            raise ValueError(f"expected tokens (8192tok) or bytes (2GiB, 500MB, 1000000), "
                             f"got {text!r}: {exc}") from None

    def to_tokens(self, bytes_per_token: int | None) -> int:
        """:raises ValueError: for a byte budget without a size per token."""
        if self.tokens is not None:
            return self.tokens
        if not bytes_per_token:
            raise ValueError("a budget in bytes needs the model's KV bytes per token")
        return self.bytes // bytes_per_token  # type: ignore[operator]


def kv_bytes_per_token(config: object, dtype_bytes: int, quantized: bool = False) -> int:
    """K and V of one token over all layers, from a Hugging Face model config; with
    ``quantized`` (int8/fp8 pages, one byte a value) the float16 scales beside each head
    row too (``quire.ops.kv_quant``)."""
    from quire.ops.kv_quant import scale_bytes

    layers = config.num_hidden_layers  # type: ignore[attr-defined]
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore
    extra = scale_bytes(head_dim) if quantized else 0
    return 2 * layers * kv_heads * (head_dim * dtype_bytes + extra)


@dataclass(frozen=True)
class PolicyResult:
    """How one policy ran the workload."""

    policy: str
    peak_concurrency: int
    mean_concurrency: float
    steps: int
    #: Held-but-empty share of the held KV memory, over all steps.
    waste_share: float
    #: Share of the budget holding tokens, averaged over steps.
    filled_share: float
    preemptions: int = 0

    def figures(self) -> dict[str, float]:
        return {"peak_concurrency": self.peak_concurrency,
                "mean_concurrency": self.mean_concurrency, "steps": self.steps,
                "waste_share": self.waste_share, "filled_share": self.filled_share,
                "preemptions": self.preemptions}


class _Tally:
    """Per-step counts, summed into a :class:`PolicyResult`."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self.steps = self.running_sum = self.peak = 0
        self.held = self.filled = 0

    def record(self, running: int, held: int, filled: int) -> None:
        self.steps += 1
        self.running_sum += running
        self.peak = max(self.peak, running)
        self.held += held
        self.filled += filled

    def result(self, policy: str, preemptions: int = 0) -> PolicyResult:
        steps = max(self.steps, 1)
        waste = (self.held - self.filled) / self.held if self.held else 0.0
        return PolicyResult(policy, self.peak, self.running_sum / steps, self.steps, waste,
                            self.filled / (self.budget * steps), preemptions)


def _sequences(requests: list[BenchRequest]) -> list[Sequence]:
    return [Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(r.prompt_token_ids),
                     params=SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                     arrival=i)
            for i, r in enumerate(requests)]


def _done(seq: Sequence) -> bool:
    return seq.num_output_tokens >= (seq.params.max_tokens or 0)


def simulate_paged(requests: list[BenchRequest], budget_tokens: int, block_size: int,
                   enable_prefix_caching: bool = True) -> PolicyResult:
    """Run the workload on a real :class:`BlockManager` of ``budget_tokens // block_size``
    pages. :raises ValueError: when a request could never fit in the pool."""
    pool = BlockManager(budget_tokens // block_size, block_size, enable_prefix_caching)
    seqs = _sequences(requests)
    for seq, request in zip(seqs, requests):
        if pool.blocks_for(request.prompt_len + request.output_len - 1) > pool.num_blocks:
            raise ValueError(f"request {seq.request_id} ({request.prompt_len}+"
                             f"{request.output_len} tokens) cannot fit in {pool.num_blocks} "
                             f"pages of {block_size}")
    waiting, running = deque(seqs), list[Sequence]()
    tally, preemptions = _Tally(pool.num_blocks * block_size), 0
    while waiting or running:
        preempted = False
        for seq in running:
            if seq not in running:
                continue  # preempted earlier in this step
            while not pool.allocate(seq, 1):
                victim = running.pop()  # newest first, as the scheduler does
                pool.free(victim)
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is seq:
                    break
            else:
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(0)
        while waiting and not preempted and _admit_paged(pool, waiting[0]):
            running.append(waiting.popleft())
        tally.record(len(running), pool.num_used_blocks * block_size,
                     _filled_slots(running, block_size))
        for seq in [s for s in running if _done(s)]:
            running.remove(seq)
            pool.free(seq)
    pool.check_invariants(())
    return tally.result("paged", preemptions)


def _admit_paged(pool: BlockManager, seq: Sequence) -> bool:
    """Allocate the pages of every known token (prompt, and outputs after a preemption),
    compute them, and sample one token."""
    cached = pool.find_cached_prefix(seq)
    if not pool.allocate(seq, seq.num_tokens - len(cached) * pool.block_size, cached):
        return False
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_blocks(seq, seq.num_computed_tokens)
    seq.output_token_ids.append(0)
    return True


def _filled_slots(running: list[Sequence], block_size: int) -> int:
    """Token slots holding K/V, counting a page shared by several sequences once."""
    filled: dict[int, int] = {}
    for seq in running:
        for i, page in enumerate(seq.block_table):
            in_page = min(block_size, seq.num_computed_tokens - i * block_size)
            filled[page] = max(filled.get(page, 0), in_page)
    return sum(filled.values())


def simulate_contiguous(requests: list[BenchRequest], budget_tokens: int,
                        reserve: Callable[[BenchRequest], int], policy: str) -> PolicyResult:
    """Run the workload reserving ``reserve(request)`` tokens per sequence for its life.

    :raises ValueError: when a request needs more than its reservation or the budget.
    """
    seqs = _sequences(requests)
    need = {seq.seq_id: reserve(r) for seq, r in zip(seqs, requests)}
    for seq, request in zip(seqs, requests):
        total = request.prompt_len + request.output_len
        if total - 1 > need[seq.seq_id] or need[seq.seq_id] > budget_tokens:
            raise ValueError(f"{policy}: request {seq.request_id} needs {total} tokens and "
                             f"reserves {need[seq.seq_id]} of a {budget_tokens}-token budget")
    waiting, running = deque(seqs), list[Sequence]()
    tally, reserved = _Tally(budget_tokens), 0
    while waiting or running:
        for seq in running:
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(0)
        while waiting and reserved + need[waiting[0].seq_id] <= budget_tokens:
            seq = waiting.popleft()
            reserved += need[seq.seq_id]
            seq.num_computed_tokens = seq.num_tokens
            seq.output_token_ids.append(0)
            running.append(seq)
        tally.record(len(running), reserved, sum(s.num_computed_tokens for s in running))
        for seq in [s for s in running if _done(s)]:
            running.remove(seq)
            reserved -= need[seq.seq_id]
    return tally.result(policy)


def compare(requests: list[BenchRequest], budget_tokens: int, block_size: int,
            max_model_len: int, enable_prefix_caching: bool = True) -> list[PolicyResult]:
    """Paged, contiguous at ``max_model_len``, contiguous at prompt + max_tokens."""
    return [
        simulate_paged(requests, budget_tokens, block_size, enable_prefix_caching),
        simulate_contiguous(requests, budget_tokens, lambda r: max_model_len,
                            "contiguous (max_model_len)"),
        simulate_contiguous(requests, budget_tokens, lambda r: r.prompt_len + r.output_len,
                            "contiguous (prompt+max_tokens)"),
    ]
