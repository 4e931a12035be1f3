"""The scheduler: token-level continuous batching under a token budget, by priority then
arrival (FCFS among equal priorities).

Each step it walks the running sequences oldest first, giving each the tokens it still
needs (one for a decoding sequence, the next chunk for a prompt being prefilled), then
admits waiting sequences while the token budget, the sequence cap and the page pool allow.
A step may therefore mix decode tokens with prefill chunks; with chunked prefill a long
prompt is cut to the budget that is left, so it never stalls the decoders.

When a running sequence cannot get a page, the last running sequence in (priority,
arrival) order (the newest of the lowest priority) is preempted: its
pages go back to the pool and it returns to the front of the waiting queue, to be
recomputed later (the prefix cache often hands its pages straight back). No waiting
sequence is admitted in a step that preempted.

With a pipeline, up to ``depth`` steps (micro-batches) are in flight at once, each on
another stage. A sequence in a step not yet completed is skipped (it waits for its
token), never preempted, and each micro-batch takes at most its share of the live
sequences (``ceil(live / depth)``), so that decoding sequences split into ``depth``
groups that take turns and every stage stays busy.

With async scheduling the engine schedules the next step before the host has the tokens
the current one sampled: each such sequence carries one *pending* token
(``Sequence.num_pending_tokens``), counted as known here (its uncomputed tokens, whether
the step samples, the pages it needs), and the step computes it from the device. A
sequence whose pending token will surely end it by length is not scheduled, so no
sequence outgrows the K/V it was admitted for. Depth is 1 then: the previous step is
complete when the next is scheduled, so every running sequence may be preempted.

With speculative decoding a decoding sequence may carry draft tokens
(``Sequence.spec_token_ids``): they are computed after its last token in the same step
(``ScheduledSeq.spec``), within the budget and only on pages that leave one free for each
running sequence after it. After verification :meth:`Scheduler.settle_drafts` keeps only
the accepted tokens' K/V as computed and gives the rejected drafts' pages back.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from quire.engine.block_manager import BlockManager
from quire.engine.encoder_cache import EncoderCache
from quire.engine.sequence import Sequence, SequenceStatus
from quire.multimodal.inputs import MMItem


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_tokens)``, the last
    ``len(spec)`` of them draft tokens (speculative decoding) after its known ones."""

    seq: Sequence
    start: int
    num_tokens: int
    spec: tuple[int, ...] = ()
    #: Images the workers encode for this step (none holds them yet).
    encode: tuple[MMItem, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the last known (or pending) token, so its logits
        are sampled (with drafts, at that token and at each draft)."""
        return self.end == self.seq.num_tokens_with_pending + len(self.spec)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class SchedulerStats:
    """Counters since the scheduler was created."""

    num_preemptions: int = 0
    #: Prompt tokens looked up in the prefix cache at admission, and found there.
    prefix_queries: int = 0
    prefix_hits: int = 0
    #: The most KV pages held at once, as each step's pages were allocated.
    peak_used_blocks: int = 0


def check_fits(request_id: str, num_prompt_tokens: int, max_kv_tokens: int, *,
               block_size: int, num_blocks: int, max_num_batched_tokens: int,
               enable_chunked_prefill: bool) -> None:
    """Refuse a request that could never be scheduled (it would wait forever): more K/V
    than the whole page pool, or a prompt over the token budget without chunked prefill.
    The scheduler checks on :meth:`Scheduler.add`; a front checks before sending.

    :raises ValueError: naming the numbers.
    """
    pages = -(-max_kv_tokens // block_size)
    if pages > num_blocks:
        raise ValueError(
            f"request {request_id} may hold {max_kv_tokens} tokens of K/V "
            f"({pages} pages of {block_size}), but the cache holds only {num_blocks} pages; "
            "raise kv_cache_memory or lower max_tokens"
        )
    if not enable_chunked_prefill and num_prompt_tokens > max_num_batched_tokens:
        raise ValueError(
            f"request {request_id} has {num_prompt_tokens} prompt tokens, more than "
            f"max_num_batched_tokens={max_num_batched_tokens} without chunked prefill"
        )


class Scheduler:
    """Owns the waiting and running sequences and the block manager."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        depth: int = 1,
        max_loras: int | None = None,
        encoder: EncoderCache | None = None,
        whole_images: bool = False,
    ) -> None:
        """:param depth: steps that may be in flight at once (pipeline stages).
        :param max_loras: LoRA adapters the running sequences may use at once (the
            workers' device slots; None: no adapters).
        :param encoder: an image-text model's image embeddings held by the workers and
            the step's encoder budget (None: a text model).
        :param whole_images: an image's tokens are never split across steps (a model
            whose images attend within themselves both ways)."""
        self.block_manager = block_manager
        self.encoder = encoder
        self.whole_images = whole_images
        self._step_encoded = 0  # embeddings the step being scheduled encodes
        self.depth = depth
        self.max_loras = max_loras
        #: Sequences in steps scheduled but not completed (by seq_id).
        self._in_flight: set[int] = set()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Both queues are kept in (priority, arrival) order: FCFS admission within a
        # priority, and the newest of the lowest priority is preempted first.
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence, max_kv_tokens: int) -> None:
        """Queue ``seq``, whose K/V may grow to ``max_kv_tokens`` tokens (its longest
        length minus one: the last sampled token is never run through the model).

        :raises ValueError: when that many tokens could never fit the page pool, since the
            sequence would otherwise wait forever.
        """
        check_fits(seq.request_id, seq.num_tokens, max_kv_tokens,
                   block_size=self.block_manager.block_size,
                   num_blocks=self.block_manager.num_blocks,
                   max_num_batched_tokens=self.max_num_batched_tokens,
                   enable_chunked_prefill=self.enable_chunked_prefill)
        seq.status = SequenceStatus.WAITING
        self._insert_waiting(seq)

    def fork(self, parent: Sequence, child: Sequence, shared: int | None = None) -> None:
        """Queue ``child``, another sample of ``parent``'s prompt, on the parent's pages.

        The parent must have computed its prompt. The child shares every full prompt page
        but the one holding the last prompt token (whose logits it needs), and computes
        the rest itself when admitted. A beam (its tokens the parent's and one more)
        passes ``shared``: the parent's full computed pages.
        """
        bm = self.block_manager
        if shared is None:
            shared = (parent.num_prompt_tokens - 1) // bm.block_size
        bm.share(parent, child, shared)
        child.num_computed_tokens = shared * bm.block_size
        child.status = SequenceStatus.WAITING
        self._insert_waiting(child)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its pages at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its pages (it may still be listed as running,
        or waiting: preempted while its last token was pending)."""
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if self.encoder is not None and seq.mm_items:
            self.encoder.release(seq.seq_id, seq.mm_items)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens. Allocates their pages; computes nothing. The
        scheduled sequences are in flight until :meth:`complete_step`."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._step_encoded = 0
        # this micro-batch's share of the live sequences (all of them without a pipeline)
        seats = -(-(len(self.running) + len(self.waiting)) // self.depth)
        budget = self._schedule_running(out, budget, seats)
        if not out.preempted:
            self._admit_waiting(out, budget, seats - len(out.scheduled))
        self._in_flight.update(s.seq.seq_id for s in out.scheduled)
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks,
                                          self.block_manager.num_used_blocks)
        return out

    def in_flight(self, seq: Sequence) -> bool:
        return seq.seq_id in self._in_flight

    def _schedule_running(self, out: SchedulerOutput, budget: int, seats: int) -> int:
        # per running sequence per step: Sequence's counts inlined, names bound once
        running, in_flight, scheduled = self.running, self._in_flight, out.scheduled
        allocate = self.block_manager.allocate
        i = 0
        while i < len(running) and budget > 0 and len(scheduled) < seats:
            seq = running[i]
            known = (len(seq.prompt_token_ids) + len(seq.output_token_ids)
                     + seq.num_pending_tokens)  # seq.num_tokens_with_pending
            if seq.seq_id in in_flight or (seq.num_pending_tokens
                                           and known >= seq.max_num_tokens):
                i += 1  # in flight, or seq.pending_finishes_it
                continue
            num = known - seq.num_computed_tokens  # seq.num_uncomputed_tokens
            if num <= 0:
                i += 1  # a beam waiting for its group's next tokens
                continue
            if seq.mm_items:
                num = self._fit_images(seq, seq.num_computed_tokens, min(num, budget))
                if num <= 0:
                    i += 1  # its next image waits for encoder room
                    continue
            # drafts ride behind the known tokens, within the budget, and only on pages
            # that leave one free for each running sequence after this one: they never
            # cause a preemption
            n_spec = len(seq.spec_token_ids)
            if num + n_spec > budget:
                n_spec = max(0, budget - num)
                if not seq.mm_items:  # (an image's chunk may run past it: _fit_images)
                    num = min(num, budget)
            if n_spec and self._draft_pages(seq, num, n_spec) > \
                    self.block_manager.num_free_blocks - (len(running) - i - 1):
                n_spec = 0
            ok = allocate(seq, num + n_spec)
            if not ok and n_spec:
                n_spec = 0
                ok = allocate(seq, num)
            if not ok:
                victim = self._victim()
                if victim is None:  # every other sequence is in flight: wait for them
                    i += 1
                    continue
                self._preempt(victim)
                out.preempted.append(victim)
                continue  # retry seq, unless it was the victim (then the loop ends)
            scheduled.append(ScheduledSeq(
                seq, seq.num_computed_tokens, num + n_spec,
                tuple(seq.spec_token_ids[:n_spec]) if n_spec else (),
                self._encode(seq, seq.num_computed_tokens, num) if seq.mm_items else ()))
            budget -= num + n_spec
            i += 1
        return budget

    def _fit_images(self, seq: Sequence, start: int, num: int) -> int:
        """``num`` cut so that the step stops before the first image it reaches that
        is not held and does not fit the step's encoder budget or the encoder cache
        (without chunked prefill a prompt is never cut: its images all run). With
        :attr:`whole_images` a chunk ends before an image it would cut, or, when the
        image is the chunk's first token, runs to the image's end even past the budget."""
        if self.encoder is None or not self.enable_chunked_prefill:
            return num
        end, used, seen = start + num, self._step_encoded, set()
        for item in seq.mm_items:
            if not item.touches(start, end):
                continue
            if self.whole_images and item.end > end:
                if item.offset > start:
                    return item.offset - start
                end = item.end
            if self.encoder.holds(item.hash) or item.hash in seen:
                continue
            if not self.encoder.fits(item.num_embeds, used):
                return item.offset - start
            used += item.num_embeds
            seen.add(item.hash)
        return end - start

    def _encode(self, seq: Sequence, start: int, num: int) -> tuple[MMItem, ...]:
        """The images a scheduled share ``start .. start + num`` of ``seq`` has the
        workers encode; ``seq`` becomes their user (:class:`EncoderCache`)."""
        encoder = self.encoder
        if encoder is None:
            return ()
        end, fresh = start + num, {}
        for item in seq.mm_items:
            if item.touches(start, end) and not encoder.holds(item.hash):
                fresh.setdefault(item.hash, item)
        encoder.use(seq.seq_id, seq.mm_items, start, end)
        self._step_encoded += sum(item.num_embeds for item in fresh.values())
        return tuple(fresh.values())

    def _draft_pages(self, seq: Sequence, num: int, n_spec: int) -> int:
        """New pages ``seq``'s drafts need beyond those of its ``num`` known tokens."""
        bm = self.block_manager
        held = max(len(seq.block_table), bm.blocks_for(seq.num_computed_tokens + num))
        return max(0, bm.blocks_for(seq.num_computed_tokens + num + n_spec) - held)

    def _victim(self) -> Sequence | None:
        """The running sequence to preempt: the last in (priority, arrival) order that is
        in no step in flight (whose pages a stage may still be writing)."""
        for seq in reversed(self.running):
            if seq.seq_id not in self._in_flight:
                return seq
        return None

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int) -> None:
        # a sequence whose adapter would exceed max_loras waits, and the ones after it
        # may go first (vLLM's rule); it keeps its place in the queue
        passed: list[Sequence] = []
        loras = ({s.lora_id for s in self.running if s.lora_id}
                 if self.max_loras is not None else set())
        try:
            self._admit(out, budget, seats, loras, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit(self, out: SchedulerOutput, budget: int, seats: int, loras: set[int],
               passed: list[Sequence]) -> None:
        bm = self.block_manager
        admitted = 0
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and admitted < seats):
            seq = self.waiting[0]
            if seq.lora_id and seq.lora_id not in loras:
                assert self.max_loras is not None
                if len(loras) >= self.max_loras:
                    passed.append(self.waiting.popleft())
                    continue
            # A forked sample already holds its shared pages; a request that wants prompt
            # logprobs must compute every prompt position, so it takes nothing cached.
            if seq.block_table or seq.params.prompt_logprobs is not None:
                cached = []
            else:
                cached = bm.find_cached_prefix(seq)
            start = seq.num_computed_tokens + len(cached) * bm.block_size
            num_cached = len(cached) * bm.block_size
            num = seq.num_tokens_with_pending - start
            if num > budget:
                if not self.enable_chunked_prefill:
                    break
                num = budget
            if seq.mm_items:
                num = self._fit_images(seq, start, num)
                if num <= 0:
                    break  # its next image waits for encoder room
            if not bm.allocate(seq, num, cached):
                break
            self.waiting.popleft()
            if seq.lora_id:
                loras.add(seq.lora_id)
            seq.num_computed_tokens = start
            seq.num_cached_tokens = num_cached
            if seq.first_scheduled_time is None:  # a preempted sequence keeps its first
                seq.first_scheduled_time = time.monotonic()
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += num_cached
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            out.scheduled.append(ScheduledSeq(
                seq, start, num,
                encode=self._encode(seq, start, num) if seq.mm_items else ()))
            budget -= num
            admitted += 1

    def preempt(self, seq: Sequence) -> None:
        """Send running ``seq`` (in no step in flight) back to wait, freeing its pages: the
        engine's way out when beams hold the pages the rest of their group waits for."""
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        if self.encoder is not None and seq.mm_items:
            self.encoder.release(seq.seq_id, seq.mm_items)
        seq.num_computed_tokens = 0
        seq.draft_computed = -1  # its pages are gone: the drafter starts over
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.stats.num_preemptions += 1
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        # Preempted sequences are older than anything of their priority queued after
        # them, so this lands them ahead of it; new arrivals land behind their priority.
        if not self.waiting or self.waiting[-1].order <= seq.order:
            self.waiting.append(seq)
            return
        keys = [s.order for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.order), seq)

    def _insert_running(self, seq: Sequence) -> None:
        keys = [s.order for s in self.running]
        self.running.insert(bisect.bisect_right(keys, seq.order), seq)

    # -- after the step --------------------------------------------------------------------
    def complete_step(self, out: SchedulerOutput) -> None:
        """Record that the step's K/V are in the cache; their full pages become findable.
        Sequences that finished meanwhile (aborted, stopped) are only released."""
        in_flight, cache_full_blocks = self._in_flight, self.block_manager.cache_full_blocks
        finished = SequenceStatus.FINISHED
        for item in out.scheduled:
            seq = item.seq
            in_flight.discard(seq.seq_id)
            if seq.status is finished:
                continue
            end = item.start + item.num_tokens
            seq.num_computed_tokens = end
            # pages of drafts are not the sequence's until accepted (settle_drafts)
            cache_full_blocks(seq, end - len(item.spec))


    def settle_drafts(self, seq: Sequence) -> bool:
        """After the verifier appended a step's tokens to ``seq`` (speculative decoding):
        only the K/V of its tokens before the last are valid (a rejected draft's are
        not), the full pages among them become findable, and the pages past what its
        tokens need go back to the pool.

        :returns: True when ``seq``'s table shrank (its holders must be told)."""
        if seq.is_finished:
            return False
        valid = seq.num_tokens - 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, valid)
        self.block_manager.cache_full_blocks(seq, valid)
        return self.block_manager.trim(seq, seq.num_tokens) > 0
