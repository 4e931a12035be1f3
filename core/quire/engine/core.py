"""``EngineCore``: tokens in, tokens out. The scheduler, the KV page pool, the executor
(and through it the model on every rank) and the sampler; no tokenizer work beyond
finding the EOS ids, no text.

It runs either inside the front's process (``LLM``, in-process serving) or as its own
process with a busy loop (:mod:`quire.engine.core_proc`); either way its front sends
:class:`~quire.engine.messages.CoreRequest` and reads one
:class:`~quire.engine.messages.CoreOutputs` per step. Token rules end sequences here
(EOS, stop token ids, ``max_tokens``, the context); stop strings are found by the front,
which then calls :meth:`stop_sequence`.

With ``async_scheduling`` one :meth:`EngineCore.step` completes step k and submits step
k+1 before step k's tokens reach the host (:meth:`EngineCore._step_async`; with
speculative decoding, only while drafts are off), so the host's
work overlaps the device's; outputs and stops are the same, found one step later.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from quire.config import EngineConfig, ResolvedConfig
from quire.engine.beam_search import BeamGroup, check_beam_fits, check_beam_params
from quire.engine.block_manager import BlockManager
from quire.engine.kv_budget import KVShare, KVShareSpec
from quire.engine.messages import (
    BeamResult,
    CoreInfo,
    CoreOutputs,
    CoreRequest,
    EngineStats,
    PromptLogprobs,
    SeqUpdate,
    ThinkingTokens,
)
from quire.engine.prompt_bands import band_index, prompt_len_bands
from quire.engine.scheduler import Scheduler, SchedulerOutput, check_fits
from quire.engine.sequence import Sequence
from quire.engine.speculation import Speculator
from quire.engine.encoder_cache import EncoderCache
from quire.engine.step_items import ItemBuilder
from quire.executor import check_parallel, make_executor, worker_config
from quire.executor.abstract import Executor
from quire.executor.model_runner import StepResult
from quire.executor.worker import model_max_len
from quire.heap import release_freed_heap
from quire.interfaces.platform import Platform, configure_platform
from quire.model_store import model_path_of
from quire.models.loader import checkpoint_dtype, load_model_config
from quire.models.pooling import check_task, context_length, model_task
from quire.multimodal.inputs import check_images
from quire.multimodal.mrope import check_mrope
from quire.multimodal.processor import image_family, takes_images
from quire.plugins.registry import PlatformRegistry
from quire.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from quire.sampling_params import SamplingParams
from quire.spec.draft import check_draft
from quire.structured.backend import (
    GrammarBackend,
    Matcher,
    apply_bitmask,
    bitmask_words,
    make_grammar_backend,
)
from quire.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

#: Seconds a step that could run nothing sleeps under a shared KV budget, while other
#: models give pages back (instead of spinning on the CPU they need to finish).
KV_WAIT_S = 0.002


@dataclass
class _Request:
    """The core's view of a request: its sequences (sample 0 first; the others once
    forked) and how many prompt logprob positions it reported."""

    request: CoreRequest
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs_known: int = 1  # the first prompt token has none
    #: A beam search request's group (its ``seqs`` are then every beam it ever had).
    beams: BeamGroup | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.request.params.n and all(
            s.is_finished for s in self.seqs)


class _Thinking:
    """Where a sequence stands in its thinking: ``first`` (its first token may open
    it), ``thinking`` (no grammar), ``answer`` (the grammar holds every token)."""

    def __init__(self, tokens: ThinkingTokens) -> None:
        self.tokens = tokens
        self.phase = "thinking" if tokens.start is None else "first"

    def answering(self, token: int) -> bool:
        """Advance past a sampled token; True when the grammar is to take it."""
        if self.phase == "first":
            self.phase = "thinking" if token == self.tokens.start else "answer"
            return self.phase == "answer"
        if self.phase == "thinking":
            if token == self.tokens.end:
                self.phase = "answer"
            return False
        return True


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word, as the signed value torch stores."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> list[int]:
    """The prompt as ints; raises ValueError naming what is wrong (the front and the core
    both call it)."""
    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if len(tokens) > max_model_len:
        raise ValueError(
            f"the prompt has {len(tokens)} tokens, more than max_model_len={max_model_len}")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tokens


def max_kv_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """The most K/V tokens a sequence may hold: its longest length minus one (the last
    sampled token is never run through the model)."""
    longest = num_prompt_tokens + params.max_output_tokens(num_prompt_tokens, max_model_len)
    return max(num_prompt_tokens, longest - 1)


def check_request(request_id: str, token_ids: list[int], params: SamplingParams,
                  config: ResolvedConfig, vocab_size: int, num_blocks: int) -> list[int]:
    """Everything that would make a request fail or wait forever, checked before it is
    queued (by the front before sending, and by the core again).

    :returns: the prompt as ints.
    :raises ValueError: naming what is wrong.
    """
    tokens = check_prompt(token_ids, config.max_model_len, vocab_size)
    params.check_against(max_logprobs=config.engine.max_logprobs, vocab_size=vocab_size)
    check_fits(request_id, len(tokens),
               max_kv_tokens(len(tokens), params.for_sequence(0), config.max_model_len),
               block_size=config.block_size, num_blocks=num_blocks,
               max_num_batched_tokens=config.max_num_batched_tokens,
               enable_chunked_prefill=config.enable_chunked_prefill)
    if params.use_beam_search:
        check_beam_params(params)
        check_beam_fits(request_id, params,
                        max_kv_tokens(len(tokens), params, config.max_model_len),
                        config.block_size, num_blocks, config.max_num_seqs)
    return tokens


class EngineCore:
    """Schedules, runs the model, samples. Not thread-safe; one owner calls it.

    Call :meth:`shutdown` to stop the executor's worker processes (none at world size 1).
    """

    #: Called as ``observer(request_id, first_pos, logits)`` with every chunk of prompt
    #: logits a request that asked for ``prompt_logprobs`` gets, before its top-k is
    #: taken: float32 ``[k, vocab]`` rows, on the device they were computed on, for
    #: prompt positions ``first_pos .. first_pos+k-1`` (each predicts the next prompt
    #: token). A recompute after preemption repeats positions. The rows are valid only
    #: during the call. For tools that need whole distributions (``quire bench
    #: accuracy``); None (the default) costs nothing.
    prompt_logits_observer: Callable[[str, int, torch.Tensor], None] | None = None

    def __init__(self, config: EngineConfig, registry: PlatformRegistry | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 kv_share: KVShareSpec | None = None):
        """:param tokenizer: the front's, when it shares this process (the core only reads
            its EOS ids); loaded here otherwise.
        :param kv_share: this engine's slot in a KV memory budget shared with other
            models' engines (:mod:`quire.engine.kv_budget`)."""
        registry = registry or PlatformRegistry()
        self.platform: Platform = registry.resolve(config.device)
        configure_platform(self.platform, config)  # bad options fail here, not in a worker
        model_path = model_path_of(config)
        self.model_config = load_model_config(model_path)
        self._model_max_len = context_length(model_path, model_max_len(self.model_config))
        auto_dtype = self.platform.auto_dtype(checkpoint_dtype(self.model_config))
        self.config: ResolvedConfig = config.resolve(
            model_max_len=self._model_max_len,
            platform_block_size=self.platform.default_block_size,
            platform_dtype=auto_dtype,
            model_task=model_task(model_path, self.model_config),
        )
        self.platform.check_dtype(self.config.dtype)
        self._bands = prompt_len_bands(self.config.max_model_len)  # for stats()
        check_task(self.config.task, self.model_config, config.world_size)
        check_parallel(config, self.model_config)
        tokenizer = tokenizer or load_tokenizer(config.tokenizer or model_path)
        self._tokenizer = tokenizer  # for the grammar engine, built on first use
        self.eos_token_ids = eos_token_ids(tokenizer, self.model_config, model_path)
        self.vocab_size: int = self.model_config.vocab_size
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            check_draft(spec, self.vocab_size, tokenizer)  # before a worker loads it
        self.takes_images = takes_images(self.model_config)
        #: Its positions are M-RoPE's (each image item carries its grid).
        self.uses_mrope = (self.takes_images
                           and image_family(self.model_config).mrope_grid is not None)
        if self.takes_images and spec is not None and spec.method != "ngram":
            raise ValueError(f"speculative decoding with method {spec.method!r} does not "
                             "run image-text models (the proposer never sees the images); "
                             "use method 'ngram'")

        # the workers run at this core's dtype and platform choices, not at what auto
        # means on their hosts
        settled = self.platform.settle_options(config.platform_options or {},
                                               dtype_auto=config.dtype == "auto")
        self.executor: Executor = make_executor(
            worker_config(config, self.config.dtype, settled), registry)
        if not self.executor.runs_model_here:
            # The model runs in the workers; this process only samples, and OpenMP
            # threads spinning after each sampling op took the workers' cores (W2's
            # inter-token latency doubled; figures in docs/bench.md).
            torch.set_num_threads(1)
        try:
            self.kv_spec = self.executor.kv_spec
            # Never more pages than max_num_seqs sequences of max_model_len tokens can
            # hold: a small model's default budget would otherwise be millions of pages
            # that only cost start-up time and bookkeeping memory.
            most = self.config.max_num_seqs * -(-self.config.max_model_len
                                                // self.config.block_size)
            num_blocks = self.executor.num_kv_blocks()
            self._kv_share: KVShare | None = None
            # a model that keeps no KV (an encoder) takes no part of the shared budget
            if kv_share is not None and self.executor.bytes_per_block() > 0:
                num_blocks, self._kv_share = self._join_kv_share(kv_share, num_blocks)
            num_blocks = min(num_blocks, most)
            self.executor.init_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.block_manager = BlockManager(num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        if self._kv_share is not None:  # pages come as the budget grants them
            self.block_manager.set_limit(0)
            self.executor.release_kv_pages(0, num_blocks)
        self.scheduler = Scheduler(
            self.block_manager,
            max_loras=self.config.engine.max_loras if self.config.engine.enable_lora
            else None,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
            depth=self.executor.max_in_flight,
            # one step's share of image encoding, and what the workers keep, in
            # embeddings: the token budget for both (vLLM's default)
            encoder=EncoderCache(self.config.max_num_batched_tokens,
                                 self.config.max_num_batched_tokens)
            if self.takes_images else None,
            whole_images=self.takes_images and image_family(self.model_config).bidirectional,
        )
        # steps submitted and not yet completed, oldest first (pipeline micro-batches)
        self._in_flight: collections.deque[tuple[SchedulerOutput, object]] = \
            collections.deque()
        spec = config.speculative_config
        self._speculator = Speculator(spec) if spec is not None else None
        # what the workers' input batches hold: each sequence's pages cross once
        self._items = ItemBuilder(self._speculator.draft_kv if self._speculator else None)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
                               seed=config.seed)
        # generate only: an embedding's step ends its request, with nothing to overlap
        self._async = config.async_scheduling and self.config.task == "generate"
        self._requests: dict[str, _Request] = {}
        self._beam_rids: set[str] = set()  # beam search requests not finished
        self._grammars: GrammarBackend | None = None
        self._matchers: dict[int, Matcher] = {}  # by seq_id, for structured outputs
        self._thinking: dict[int, _Thinking] = {}  # by seq_id: grammars held after it
        self._finished: list[str] = []  # ended since the last output
        self._num_requests = 0
        self._next_seq_id = 0
        self.info = CoreInfo(
            platform_name=self.platform.name, device_type=self.platform.device_type,
            platform_block_size=self.platform.default_block_size,
            platform_dtype=str(auto_dtype).removeprefix("torch."),
            model_max_len=self._model_max_len, vocab_size=self.vocab_size,
            num_blocks=num_blocks, eos_token_ids=sorted(self.eos_token_ids),
            world_size=self.executor.world_size,
            worker_processes=0 if self.executor.runs_model_here else self.executor.world_size,
            task=self.config.task)
        logger.info(
            "engine core ready: platform=%s dtype=%s block_size=%d kv_pages=%d (%d tokens) "
            "executor=%s world_size=%d async_scheduling=%s", self.platform.name,
            self.config.dtype, self.config.block_size, num_blocks,
            num_blocks * self.config.block_size, config.executor_backend,
            self.executor.world_size, "on" if self._async else "off",
        )
        release_freed_heap()  # what loading freed (the tokenizer's parse, the profile step)

    def _join_kv_share(self, spec: KVShareSpec, measured: int
                       ) -> tuple[int, KVShare | None]:
        """This engine's pool under a shared budget, and its share of it (None when the
        backend cannot give memory back: then the pool is a fixed, equal part).

        The first engine to start sets the budget to the pool it measured."""
        share = KVShare(spec, self.executor.bytes_per_block())
        budget = share.budget_bytes(measured * share.bytes_per_block)
        pages = budget // share.bytes_per_block
        if self.executor.releases_kv_memory:
            return pages, share
        parts = share.ledger.num_slots
        logger.warning("the %s backend cannot give KV memory back: this model's pool is a "
                       "fixed 1/%d of the shared budget", self.platform.name, parts)
        share.close()
        return max(1, pages // parts), None

    def tend_kv_share(self) -> None:
        """Under a shared budget: tell the ledger what this engine wants, move the pool's
        limit to what it grants, and give back the memory of pages released (between
        steps, and while idle so that an idle engine's cached pages can go)."""
        if self._kv_share is None:
            return
        bm = self.block_manager
        released = self._kv_share.tend(bm, self._kv_want())
        if released is not None:
            self.executor.release_kv_pages(*released)

    def _kv_want(self) -> int:
        """Pages this engine wants: its used ones, one more per running sequence, and
        each waiting prompt's."""
        bm, sched = self.block_manager, self.scheduler
        want = bm.num_used_blocks + len(sched.running)
        for seq in sched.waiting:
            if want >= bm.num_blocks:
                break
            want += bm.blocks_for(seq.num_tokens + 1)
        return min(want, bm.num_blocks)

    def shutdown(self) -> None:
        """Stop the executor's workers; safe to call more than once."""
        if self._kv_share is not None:
            self._kv_share.close()
            self._kv_share = None
        self.executor.shutdown()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request: CoreRequest) -> None:
        """Queue a request.

        :raises ValueError: for a bad prompt, parameters outside this engine's limits, a
            duplicate id, or a request the KV cache could never hold.
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        tokens = check_request(rid, request.prompt_token_ids, request.params, self.config,
                               self.vocab_size, self.block_manager.num_blocks)
        if request.mm:
            check_images(rid, request.mm, len(tokens), self.takes_images)
            if self.uses_mrope:
                check_mrope(rid, request.mm)
        params = request.params
        if params.use_beam_search and self._speculator is not None:
            raise ValueError("use_beam_search does not run with speculative decoding")
        seq = self._new_sequence(request, tokens, index=0)
        self._start_matcher(seq, request.thinking)
        try:
            self.scheduler.add(seq, max_kv_tokens(len(tokens), seq.params,
                                                  self.config.max_model_len))
        except ValueError:
            self._release(seq)
            raise
        self._requests[rid] = _Request(request, [seq])
        if params.use_beam_search:
            self._requests[rid].beams = BeamGroup.start(
                seq, params, frozenset(self.eos_token_ids),
                params.max_output_tokens(len(tokens), self.config.max_model_len))
            self._beam_rids.add(rid)
        self._num_requests += 1

    def _new_sequence(self, request: CoreRequest, tokens: list[int], index: int,
                      arrival: int | None = None) -> Sequence:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        # each sample gets its own parameters (n=1, a seeded request's seed + index)
        params = request.params.for_sequence(index)
        longest = len(tokens) + max(1, params.max_output_tokens(len(tokens),
                                                                self.config.max_model_len))
        lora = request.lora
        if lora is not None and not self.config.engine.enable_lora:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is "
                             "disabled: start the engine with enable_lora=True")
        return Sequence(seq_id=seq_id, request_id=request.request_id,
                        prompt_token_ids=tokens, params=params,
                        arrival=seq_id if arrival is None else arrival, index=index,
                        priority=request.priority + index, max_num_tokens=longest,
                        lora_id=0 if lora is None else lora.lora_int_id,
                        lora_path="" if lora is None else lora.lora_path,
                        mm_items=list(request.mm))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests now and free their pages; unknown or finished ids are ignored."""
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self._beam_rids.discard(rid)
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.abort(seq)
                self._release(seq)

    def grammars(self) -> GrammarBackend:
        """The grammar engine, built from the tokenizer on first use."""
        if self._grammars is None:
            self._grammars = make_grammar_backend(self._tokenizer, self.vocab_size,
                                                  sorted(self.eos_token_ids))
        return self._grammars

    def _start_matcher(self, seq: Sequence, thinking: ThinkingTokens | None) -> None:
        spec = seq.params.structured_outputs
        if spec is not None:
            self._matchers[seq.seq_id] = self.grammars().matcher(spec)
            if thinking is not None:
                self._thinking[seq.seq_id] = _Thinking(thinking)

    def _release(self, seq: Sequence) -> None:
        """What a finished sequence held besides its pages: its generator, its matcher,
        its table in the workers' input batches."""
        self.sampler.release(seq.seq_id)
        self._items.release(seq.seq_id)
        if self._speculator is not None:
            self._speculator.forget(seq.seq_id)
        self._matchers.pop(seq.seq_id, None)
        self._thinking.pop(seq.seq_id, None)

    def abort_all(self) -> None:
        """Abort every request (after a failed step)."""
        self.abort_requests(list(self._requests))

    def stop_sequence(self, request_id: str, index: int) -> None:
        """Finish sample ``index`` (the front found a stop string in its text)."""
        req = self._requests.get(request_id)
        if req is None or index >= len(req.seqs) or req.seqs[index].is_finished:
            return
        seq = req.seqs[index]
        self.scheduler.finish(seq, "stop")
        self._release(seq)
        if req.finished:
            del self._requests[request_id]
            self._finished.append(request_id)

    def take_finished(self) -> list[str]:
        """Requests that ended since the previous call (every sample finished)."""
        done, self._finished = self._finished, []
        return done

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or steps still in flight (to be collected)."""
        return bool(self._requests) or bool(self._in_flight)

    def stats(self) -> EngineStats:
        """A snapshot of the scheduler's queues and the KV pool; call between steps."""
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_usage=bm.usage, num_used_blocks=bm.num_used_blocks, num_blocks=bm.num_blocks,
            num_preemptions=sched.stats.num_preemptions,
            prefix_queries=sched.stats.prefix_queries, prefix_hits=sched.stats.prefix_hits,
            has_unfinished=self.has_unfinished_requests(), num_requests=self._num_requests,
            peak_used_blocks=sched.stats.peak_used_blocks,
            prompt_len_bands=self._bands, kv_blocks_by_prompt_len=self._kv_by_band(),
            **self._spec_stats(),
        )

    def _kv_by_band(self) -> list[int]:
        """KV pages held by the running sequences of each prompt-length band. Per step, so
        the running batch only: a long waiting queue holds no pages (but forked samples
        and beams not admitted yet, which the pool's total counts)."""
        held = [0] * len(self._bands)
        bands = self._bands
        for seq in self.scheduler.running:
            held[band_index(len(seq.prompt_token_ids), bands)] += len(seq.block_table)
        return held

    def _spec_stats(self) -> dict[str, object]:
        if self._speculator is None:
            return {}
        spec = self._speculator.stats
        return {"spec_num_drafts": spec.num_drafts,
                "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_pos": list(spec.accepted_per_pos)}

    # -- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> CoreOutputs:
        """Schedule, run one forward, sample; report every sequence that got a token.

        With a pipeline, first fill it: schedule and submit micro-batches (each of
        sequences in no other) until ``depth`` are in flight, then complete the oldest.
        With async scheduling, see :meth:`_step_async`; with speculative decoding too,
        a step is synchronous while drafts are due (:meth:`_drafts_due`) and
        asynchronous while they are not.
        """
        self.tend_kv_share()
        # beams pick their tokens together on the host: a beam search runs synchronously
        if self._async and not self._drafts_due() and not self._beam_rids:
            return self._step_async()
        while len(self._in_flight) < self.scheduler.depth and self._schedule_next():
            pass
        if not self._in_flight:
            return self._idle()
        out, result = self._complete_oldest()
        outputs = CoreOutputs()
        if result.pooled is not None:
            self._finish_embeddings(out, result.sample_items, result.pooled, outputs)
            return self._report(outputs)
        seqs, logits, drafts = self._live_rows(out, result, outputs)
        if seqs and self._beam_rids:
            seqs, logits = self._take_beam_rows(seqs, logits, outputs)
        if seqs and drafts is None:
            self._mask(logits, seqs)
            self._take_tokens(seqs, self.sampler.sample(logits, seqs), outputs)
        elif seqs:
            self._verify(seqs, logits, drafts, outputs)
        if seqs and self._speculator is not None:
            self._speculator.propose(seqs, len(self.scheduler.running), self._matchers,
                                     {i for i, g in self._thinking.items()
                                      if g.phase != "answer"},
                                     num_waiting=len(self.scheduler.waiting))
        return self._report(outputs)

    def _drafts_due(self) -> bool:
        """Speculative decoding will propose drafts: the running batch is under
        ``disable_by_batch_size``. A step with drafts cannot be scheduled before the
        tokens of the step before reach the host (its drafts follow them), so async
        scheduling steps synchronously then, and asynchronously at a batch large enough
        to turn drafts off: each where it pays. Leaving drafts, the running sequences'
        last proposals are dropped (an asynchronous step verifies none)."""
        if self._speculator is None:
            return False
        limit = self._speculator.config.disable_by_batch_size
        due = limit is None or len(self.scheduler.running) < limit
        if not due:
            for seq in self.scheduler.running:
                seq.spec_token_ids = []
        return due

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]],
                outputs: CoreOutputs) -> None:
        """Speculative decoding: keep the drafts the target accepts, and one token more;
        then only the accepted tokens' K/V count as computed, and the pages of rejected
        drafts go back."""
        logits, drafts = self._cut_to_grammar(logits, seqs, drafts)
        self._mask_drafts(logits, seqs, drafts)
        verified = self.sampler.verify(logits, seqs, drafts)
        stats = self._speculator.stats if self._speculator is not None else None
        for seq, draft, tokens, logprobs, accepted in zip(
                seqs, drafts, verified.token_ids, verified.logprobs, verified.num_accepted):
            for token, entry in zip(tokens, logprobs):
                self._take_tokens([seq], SamplerOutput([token], [entry]), outputs)
                if seq.is_finished:
                    break
            if stats is not None:
                stats.record(len(draft), accepted)
            # every row owner: a draft cut to nothing by its grammar was still computed
            if self.scheduler.settle_drafts(seq):
                self._items.truncate(seq.seq_id, len(seq.block_table))

    def _step_async(self) -> CoreOutputs:
        """Complete step k and submit step k+1 before step k's tokens reach the host.

        1. wait for step k (on a device this need not sync) and complete it;
        2. sample it on the device, reading host state that holds every token up to k-1
           (penalties, ``min_tokens``, grammar masks: what a synchronous step reads);
        3. schedule step k+1, each sequence that sampled counting one pending token;
        4. submit it with the sampled ids, which the executor puts in its inputs;
        5. bring step k's tokens to the host (on a device: waiting for step k's copies
           only, while step k+1 runs) and do each token's work: append, fork, stop
           checks, grammar, finish. A sequence that a stop token, EOS or a complete
           grammar ended was scheduled once more for nothing: the row is dropped when
           step k+1 completes. Its pages are freed now, while step k+1 may still write
           them: safe, because steps run in order (one stream, or in order in each
           worker), so any later owner's writes come after.
        The first step after an idle spell is submitted and completed in one call.
        """
        if not self._in_flight:
            self._schedule_next()
        if not self._in_flight:
            return self._idle()
        out, result = self._complete_oldest()
        outputs = CoreOutputs()
        seqs, logits, _ = self._live_rows(out, result, outputs)
        if not seqs:
            self._schedule_next()
            return self._report(outputs)
        self._mask(logits, seqs)
        sample = self.sampler.sample_on_device(logits, seqs)
        for seq in seqs:
            seq.num_pending_tokens = 1
        try:
            self._schedule_next(sample.token_ids,
                                {seq.seq_id: row for row, seq in enumerate(seqs)})
        finally:
            for seq in seqs:
                seq.num_pending_tokens = 0
        self._take_tokens(seqs, self.sampler.to_host(sample), outputs)
        return self._report(outputs)

    def _complete_oldest(self) -> tuple[SchedulerOutput, StepResult]:
        """Wait for the oldest step in flight and record its K/V as computed."""
        out, handle = self._in_flight.popleft()
        result = self.executor.wait(handle)
        self.scheduler.complete_step(out)
        if self._speculator is not None and self._speculator.draft_kv is not None:
            self._speculator.draft_kv.settle(out.scheduled)
        return out, result

    def _schedule_next(self, sampled: torch.Tensor | None = None,
                       pending_rows: dict[int, int] | None = None) -> bool:
        """Schedule a step and submit it; False when there was nothing to run.

        :param sampled: the previous step's token ids on the device, and each pending
            sequence's row of it (async scheduling)."""
        out = self.scheduler.schedule()
        if not out and self._beam_rids and self._unblock_beams():
            out = self.scheduler.schedule()
        for seq in out.preempted:
            self._items.release(seq.seq_id)
        if not out:
            return False
        items = self._items.items(out.scheduled, pending_rows)
        released = self._items.take_released()
        # a synchronous step calls submit(items, released) as before async scheduling
        # existed (wrappers of it, like the host-overhead bench's, keep working)
        handle = (self.executor.submit(items, released) if sampled is None
                  else self.executor.submit(items, released, sampled=sampled))
        self._in_flight.append((out, handle))
        return True

    def _idle(self) -> CoreOutputs:
        """A step with nothing to run: only what finished meanwhile."""
        if self.scheduler.has_unfinished():
            if self._kv_share is None:
                raise RuntimeError("the scheduler found no work it could run; this is a bug")
            time.sleep(KV_WAIT_S)  # other models are to give pages back: don't spin
        return CoreOutputs(time=time.monotonic(), stats=self.stats(),
                           finished=self.take_finished())

    def _live_rows(self, out: SchedulerOutput, result: StepResult, outputs: CoreOutputs
                   ) -> tuple[list[Sequence], torch.Tensor, list[list[int]] | None]:
        """Report the step's prompt logprobs; its sampling sequences not finished while
        it was in flight (aborted, a stop string, async scheduling's one step late), and
        their logits rows; with drafts in the step, each sequence's drafts too (its rows
        are then ``1 + len(drafts)``), else None."""
        for item_idx, first_pos, logits in result.prompt_logits:
            seq = out.scheduled[item_idx].seq
            if seq.request_id not in self._requests:
                continue  # aborted while its step was in flight
            if self.prompt_logits_observer is not None:
                self.prompt_logits_observer(seq.request_id, first_pos, logits)
            entry = self._prompt_logprobs(self._requests[seq.request_id], first_pos, logits)
            if entry is not None:
                outputs.prompt_logprobs.append(entry)
        if self._speculator is not None and any(s.spec for s in out.scheduled):
            return self._live_draft_rows(out, result)
        rows = [(row, out.scheduled[i].seq) for row, i in enumerate(result.sample_items)]
        live = [(row, seq) for row, seq in rows if not seq.is_finished]
        logits = result.logits
        if len(live) < len(rows):
            logits = logits[[r for r, _ in live]]
        return [seq for _, seq in live], logits, None

    @staticmethod
    def _live_draft_rows(out: SchedulerOutput, result: StepResult
                         ) -> tuple[list[Sequence], torch.Tensor, list[list[int]]]:
        """:meth:`_live_rows` for a step with drafts: an item's rows are consecutive. A
        draft model's proposals come with the result (the step held stand-ins)."""
        seqs, drafts, keep = [], [], []
        row, items = 0, result.sample_items
        proposed = result.drafts
        while row < len(items):
            index = items[row]
            scheduled = out.scheduled[index]
            count = 1 + len(scheduled.spec)
            if not scheduled.seq.is_finished:
                seqs.append(scheduled.seq)
                drafts.append(list(scheduled.spec if proposed is None else proposed[index]))
                keep.extend(range(row, row + count))
            row += count
        logits = result.logits
        if len(keep) < len(items):
            logits = logits[keep]
        return seqs, logits, drafts

    def _take_tokens(self, seqs: list[Sequence], sampled: SamplerOutput,
                     outputs: CoreOutputs) -> None:
        """Each sequence's sampled token: append it, fork the other samples after a
        prompt, apply the token rules and the grammar, finish, report."""
        # per token: names bound once, the grammar dicts looked up only when not empty
        requests, matchers, updates = self._requests, self._matchers, outputs.updates
        stop_reason = self._stop_reason
        for row, (seq, token, logprobs) in enumerate(
                zip(seqs, sampled.token_ids, sampled.logprobs)):
            req = requests[seq.request_id]
            out_ids = seq.output_token_ids
            if not out_ids and seq.index == 0 and req.request.params.n > 1:
                self._fork(req, seq)  # before the parent can finish and free its pages
            out_ids.append(token)
            reason = stop_reason(seq, token)
            matcher = matchers.get(seq.seq_id) if matchers else None
            if matcher is not None:
                gate = self._thinking.get(seq.seq_id)
                if gate is None or gate.answering(token):
                    matcher.accept(token)
                    if reason is None and matcher.is_terminated():
                        reason = "stop"  # the grammar is complete (vLLM stops it too)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._release(seq)
            stop_id = seq.stop_reason
            updates.append(SeqUpdate(
                seq.request_id, seq.index, token, logprobs, reason,
                stop_id if isinstance(stop_id, int) else None,
                seq.num_cached_tokens, seq.first_scheduled_time))
            if reason is not None and req.finished:
                del self._requests[seq.request_id]
                self._finished.append(seq.request_id)

    def _report(self, outputs: CoreOutputs) -> CoreOutputs:
        outputs.time = time.monotonic()  # one clock read per step: the tokens exist from here
        outputs.stats = self.stats()
        outputs.finished = self.take_finished()
        return outputs

    def _finish_embeddings(self, out: SchedulerOutput, items: tuple[int, ...],
                           pooled: torch.Tensor, outputs: CoreOutputs) -> None:
        """An embedding request ends with the step that computed its prompt: its vector
        goes out with the finish and its pages go back at once (no prefix cache)."""
        data = pooled.to(device="cpu", dtype=torch.float32).numpy().astype("<f4")
        for row, i in enumerate(items):
            seq = out.scheduled[i].seq
            if seq.is_finished:
                continue  # aborted while its step was in flight
            self.scheduler.finish(seq, "stop")
            self._release(seq)
            outputs.updates.append(SeqUpdate(
                seq.request_id, seq.index, finish_reason="stop",
                first_scheduled_time=seq.first_scheduled_time,
                embedding=data[row].tobytes()))
            del self._requests[seq.request_id]
            self._finished.append(seq.request_id)

    def _mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of sequences under a grammar to the tokens it allows
        next; the other rows are untouched."""
        if not self._matchers:
            return
        rows = [r for r, seq in enumerate(seqs) if seq.seq_id in self._matchers
                and not self._is_thinking(seq.seq_id)]
        if not rows:
            return
        bitmask = torch.empty((len(rows), bitmask_words(logits.shape[1])), dtype=torch.int32)
        for i, r in enumerate(rows):
            seq_id = seqs[r].seq_id
            self._matchers[seq_id].fill_bitmask(bitmask, i)
            gate = self._thinking.get(seq_id)
            if gate is not None and gate.phase == "first":  # may open its thinking
                start = gate.tokens.start
                assert start is not None
                bitmask[i, start // 32] |= _bit(start % 32)
        apply_bitmask(logits, bitmask, rows)

    def _cut_to_grammar(self, logits: torch.Tensor, seqs: list[Sequence],
                        drafts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
        """Each sequence's drafts cut to the first one its grammar refuses, and their
        rows dropped: a draft model proposes without the grammar (n-gram drafts were cut
        before the step, and pass unchanged). A refused draft would be rejected anyway;
        the rows after it could not be masked."""
        if not self._matchers:
            return logits, drafts
        keep: list[int] = []
        cut: list[list[int]] = []
        first = 0
        for seq, draft in zip(seqs, drafts):
            matcher = self._matchers.get(seq.seq_id)
            n = len(draft)
            if draft and matcher is not None and not self._is_thinking(seq.seq_id):
                gate = self._thinking.get(seq.seq_id)
                n = 0 if gate is not None and gate.phase == "first" \
                    else matcher.num_valid(draft)
            keep.extend(range(first, first + n + 1))
            cut.append(draft[:n])
            first += len(draft) + 1
        if len(keep) == first:
            return logits, drafts
        return logits[keep], cut

    def _mask_drafts(self, logits: torch.Tensor, seqs: list[Sequence],
                     drafts: list[list[int]]) -> None:
        """:meth:`_mask` for verification rows: a sequence's row j is masked to what its
        grammar allows after its first j drafts (the matcher steps through them and
        back). A sequence whose grammar waits for its thinking to end has no drafts."""
        if not self._matchers:
            return
        rows: list[int] = []
        masks: list[tuple[Matcher, list[int]]] = []
        first = 0
        for seq, draft in zip(seqs, drafts):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is not None and not self._is_thinking(seq.seq_id):
                gate = self._thinking.get(seq.seq_id)
                if gate is not None and gate.phase == "first":
                    self._mask(logits[first : first + 1], [seq])  # one row, no drafts
                else:
                    rows.extend(range(first, first + len(draft) + 1))
                    masks.append((matcher, draft))
            first += len(draft) + 1
        if not rows:
            return
        bitmask = torch.empty((len(rows), bitmask_words(logits.shape[1])), dtype=torch.int32)
        i = 0
        for matcher, draft in masks:
            matcher.fill_bitmask(bitmask, i)
            for token in draft:
                matcher.accept(token)
                i += 1
                matcher.fill_bitmask(bitmask, i)
            matcher.rollback(len(draft))
            i += 1
        apply_bitmask(logits, bitmask, rows)

    def _is_thinking(self, seq_id: int) -> bool:
        gate = self._thinking.get(seq_id)
        return gate is not None and gate.phase == "thinking"

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """The token rules, in vLLM's order (stop strings come first, at the front)."""
        params = seq.params
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return "length"
        if len(seq.prompt_token_ids) + num_output >= self.config.max_model_len:
            return "length"
        return None

    # -- beam search (engine/beam_search.py decides; this applies) -------------------------
    def _take_beam_rows(self, seqs: list[Sequence], logits: torch.Tensor,
                        outputs: CoreOutputs) -> tuple[list[Sequence], torch.Tensor]:
        """Give each beam's row to its group, advance the groups whose every beam has
        one; the other sequences' rows are returned, for the sampler."""
        keep: list[int] = []
        ready: dict[str, _Request] = {}
        for row, seq in enumerate(seqs):
            req = self._requests[seq.request_id]
            if req.beams is None:
                keep.append(row)
                continue
            req.beams.take(seq, logits[row])
            if req.beams.ready:
                ready[seq.request_id] = req
        for req in ready.values():
            self._advance_beams(req, outputs)
        if len(keep) == len(seqs):
            return seqs, logits
        return [seqs[r] for r in keep], logits[keep]

    def _advance_beams(self, req: _Request, outputs: CoreOutputs) -> None:
        """Apply the group's choice: a parent's first child continues as the parent
        (its token appended), each other child forks from it on its full computed pages
        (shared by reference count; it recomputes only the partial page and its new
        token); a parent with no child ends. A finished group reports its hypotheses."""
        group = req.beams
        assert group is not None
        choices = group.advance()
        if group.done:
            self._finish_beams(req, outputs)
            return
        bs = self.block_manager.block_size
        kept: set[int] = set()
        continuing: list[tuple[Sequence, int]] = []
        beams: list[tuple[Sequence, float]] = []
        for choice in choices:  # forks first: they copy the parent's tokens as they are
            parent = choice.parent
            if parent.seq_id not in kept:
                kept.add(parent.seq_id)
                continuing.append((parent, choice.token))
                beams.append((parent, choice.score))
                continue
            child = self._new_sequence(req.request, parent.prompt_token_ids, index=0,
                                       arrival=parent.arrival)
            child.output_token_ids = parent.output_token_ids + [choice.token]
            self.scheduler.fork(parent, child, parent.num_computed_tokens // bs)
            req.seqs.append(child)
            beams.append((child, choice.score))
        for parent, token in continuing:
            parent.output_token_ids.append(token)
        for seq in group.beams:
            if seq.seq_id not in kept:
                self.scheduler.finish(seq, "stop")
                self._release(seq)
        group.replace(beams)

    def _finish_beams(self, req: _Request, outputs: CoreOutputs) -> None:
        """End a beam search: its beams' pages go back, its hypotheses go out."""
        assert req.beams is not None
        for seq in req.beams.beams:
            if not seq.is_finished:
                self.scheduler.finish(seq, "stop")
                self._release(seq)
        rid = req.request.request_id
        outputs.beams.append(BeamResult(rid, req.beams.result(),
                                        req.seqs[0].first_scheduled_time))
        del self._requests[rid]
        self._beam_rids.discard(rid)
        self._finished.append(rid)

    def _unblock_beams(self) -> bool:
        """Nothing could be scheduled: beams waiting for their group (holding pages and
        seats) may block the beams their groups wait for. Preempt the newest group's
        waiting beams, so older groups can go on; False when no beam waits."""
        groups = [self._requests[rid] for rid in self._beam_rids]
        for req in sorted(groups, key=lambda r: -r.seqs[0].arrival):
            assert req.beams is not None
            held = [s for s in req.beams.beams if s in self.scheduler.running
                    and s.num_uncomputed_tokens == 0 and not self.scheduler.in_flight(s)]
            for seq in held:
                self.scheduler.preempt(seq)
                self._items.release(seq.seq_id)
            if held:
                return True
        return False

    def _fork(self, req: _Request, parent: Sequence) -> None:
        """Start samples 1..n-1 on the parent's prompt pages (shared, not recomputed).

        The parent has just computed its whole prompt. Each child takes the parent's full
        prompt pages by reference and recomputes only the prompt's last partial page (at
        least its last token, whose logits it samples its own first token from).
        """
        for index in range(1, req.request.params.n):
            child = self._new_sequence(req.request, parent.prompt_token_ids, index=index,
                                       arrival=parent.arrival)
            self.scheduler.fork(parent, child)
            req.seqs.append(child)
            self._start_matcher(child, req.request.thinking)

    def _prompt_logprobs(self, req: _Request, first_pos: int,
                         logits: torch.Tensor) -> PromptLogprobs | None:
        """Logprobs of prompt tokens ``first_pos + 1 ...`` not reported yet (a recompute
        after preemption repeats positions)."""
        k = req.request.params.prompt_logprobs
        assert k is not None
        prompt = req.request.prompt_token_ids
        targets = prompt[first_pos + 1 : first_pos + 1 + logits.shape[0]]
        skip = max(0, req.prompt_logprobs_known - (first_pos + 1))
        if skip >= len(targets):
            return None
        entries = compute_prompt_logprobs(logits[skip:], torch.tensor(targets[skip:]), k)
        req.prompt_logprobs_known += len(entries)
        return PromptLogprobs(req.request.request_id, first_pos + skip, list(entries))
