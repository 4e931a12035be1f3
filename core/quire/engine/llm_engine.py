"""The engine: builds the parts once, then runs schedule -> forward -> sample steps.

Build order: platform (from the registry, for its defaults), model config, resolved
engine config, tokenizer, the executor (its workers load the model's shards), KV cache
sized by the smallest rank's memory, block manager, scheduler, sampler. One engine owns
all of these; nothing is shared between engines.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from quire.config import EngineConfig, ResolvedConfig
from quire.engine.block_manager import BlockManager
from quire.engine.output_processor import OutputProcessor, RequestState
from quire.engine.scheduler import Scheduler
from quire.engine.sequence import Sequence
from quire.executor import check_parallel, make_executor
from quire.executor.abstract import Executor
from quire.executor.messages import StepItem
from quire.executor.worker import model_max_len
from quire.interfaces.platform import Platform
from quire.model_store import resolve_model
from quire.models.loader import load_model_config
from quire.outputs import RequestOutput, RequestOutputKind
from quire.plugins.registry import PlatformRegistry
from quire.sampler import Sampler, compute_prompt_logprobs
from quire.sampling_params import SamplingParams
from quire.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """What the engine reports of its state between two steps: the one message the
    server (metrics, health, tests) reads instead of the scheduler's attributes."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    has_unfinished: bool


class LLMEngine:
    """Turns requests into outputs, one step at a time. Not thread-safe.

    Call :meth:`shutdown` (or let the ``LLM`` that owns it do so) to stop worker
    processes; at world size 1 there are none.
    """

    def __init__(self, config: EngineConfig, registry: PlatformRegistry | None = None):
        registry = registry or PlatformRegistry()
        self.platform: Platform = registry.resolve(config.device)
        model_path = resolve_model(config.model)
        self.model_config = load_model_config(model_path)
        self.config: ResolvedConfig = config.resolve(
            model_max_len=model_max_len(self.model_config),
            platform_block_size=self.platform.default_block_size,
            platform_dtype=self.platform.supported_dtypes[0],
        )
        self.platform.check_dtype(self.config.dtype)
        check_parallel(config, self.model_config)
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config, model_path)
        self.vocab_size: int = self.model_config.vocab_size

        self.executor: Executor = make_executor(config, registry)
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
            num_blocks = min(self.executor.num_kv_blocks(), most)
            self.executor.init_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.block_manager = BlockManager(num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
        )
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
                               seed=config.seed)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                         self.config.max_model_len)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        logger.info(
            "engine ready: platform=%s dtype=%s block_size=%d kv_pages=%d (%d tokens) "
            "executor=%s world_size=%d", self.platform.name, self.config.dtype,
            self.config.block_size, num_blocks, num_blocks * self.config.block_size,
            config.executor_backend, self.executor.world_size,
        )

    def shutdown(self) -> None:
        """Stop the executor's workers; safe to call more than once."""
        self.executor.shutdown()

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request. Checks everything before anything is scheduled.

        :param priority: lower is admitted first (vLLM's name); equal priorities go first
            come, first served. Sample ``i`` of the request gets ``priority + i``.
        :raises ValueError: for an empty or too long prompt, a token id outside the
            vocabulary, parameters outside this engine's limits, a duplicate request id,
            or a request the KV cache could never hold.
        """
        arrival_time = time.monotonic()
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        tokens = self._check_prompt(prompt_token_ids)
        params.check_against(max_logprobs=self.config.engine.max_logprobs,
                             vocab_size=self.vocab_size)
        seq = self._new_sequence(rid, tokens, params, index=0, priority=priority)
        self.scheduler.add(seq, self._max_kv_tokens(seq))
        req = RequestState(rid, prompt, tokens, params,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                           arrival_time=arrival_time)
        self.processor.track(req, seq)
        self._requests[rid] = req
        return rid

    def _new_sequence(self, rid: str, tokens: list[int], params: SamplingParams,
                      index: int, arrival: int | None = None,
                      priority: int = 0) -> Sequence:
        seq_id = next(self._ids)
        # each sample gets its own parameters (n=1, a seeded request's seed + index)
        return Sequence(seq_id=seq_id, request_id=rid, prompt_token_ids=tokens,
                        params=params.for_sequence(index),
                        arrival=seq_id if arrival is None else arrival, index=index,
                        priority=priority + index)

    def _max_kv_tokens(self, seq: Sequence) -> int:
        longest = seq.num_prompt_tokens + seq.params.max_output_tokens(
            seq.num_prompt_tokens, self.config.max_model_len)
        return max(seq.num_prompt_tokens, longest - 1)

    def _check_prompt(self, token_ids: Iterable[int]) -> list[int]:
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("the prompt is empty: give at least one token")
        if len(tokens) > self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens, more than max_model_len="
                f"{self.config.max_model_len}"
            )
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; unknown or finished ids are ignored.

        :returns: the request's last output, finished with reason "abort", or None.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for out in req.outputs:
            if not out.seq.is_finished:
                self.scheduler.abort(out.seq)
            self.sampler.release(out.seq.seq_id)
        for index in range(len(req.outputs), req.params.n):  # samples not forked yet
            seq = self._new_sequence(request_id, req.prompt_token_ids, req.params, index)
            self.scheduler.abort(seq)
            self.processor.track(req, seq)
        req.finished_time = time.monotonic()
        return self.processor.make_output(req, req.outputs[0].seq.num_cached_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        """A snapshot of the scheduler's queues and the KV pool; call between steps."""
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_usage=bm.usage, num_used_blocks=bm.num_used_blocks, num_blocks=bm.num_blocks,
            num_preemptions=sched.stats.num_preemptions,
            prefix_queries=sched.stats.prefix_queries, prefix_hits=sched.stats.prefix_hits,
            has_unfinished=self.has_unfinished_requests(),
        )

    # -- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, run one forward, sample; report every request that changed.

        :param final_only: report only requests that finished (skips building the
            cumulative outputs of running requests, which nobody reads offline), whatever
            each request's ``output_kind``.
        """
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found no work it could run; this is a bug")
            return []
        result = self.executor.execute([StepItem.of(s) for s in out.scheduled])
        self.scheduler.complete_step(out)
        changed: dict[str, RequestState] = {}
        for item_idx, first_pos, logits in result.prompt_logits:
            seq = out.scheduled[item_idx].seq
            self._record_prompt_logprobs(self._requests[seq.request_id], first_pos, logits)
        seqs = [out.scheduled[i].seq for i in result.sample_items]
        if seqs:
            sampled = self.sampler.sample(result.logits, seqs)
            now = time.monotonic()  # one clock read per step: the tokens exist from here
            for row, seq in enumerate(seqs):
                req = self._requests[seq.request_id]
                req.record_token(now)
                if seq.index == 0 and seq.num_output_tokens == 0 and req.params.n > 1:
                    self._fork(req, seq)  # before the parent can finish and free its pages
                token, lp = sampled.token_ids[row], sampled.logprobs[row]
                logprobs = None if lp is None else self.processor.token_logprobs(
                    token, lp.logprob, lp.rank, lp.top)
                reason = self.processor.append_token(req, req.outputs[seq.index], token,
                                                     logprobs)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    self.sampler.release(seq.seq_id)
                changed[req.request_id] = req
        outputs = []
        for rid, req in changed.items():
            finished = req.finished
            if finished:
                req.finished_time = time.monotonic()
            if finished or not (final_only or
                                req.params.output_kind is RequestOutputKind.FINAL_ONLY):
                outputs.append(self.processor.make_output(req,
                                                          req.outputs[0].seq.num_cached_tokens))
            if finished:
                del self._requests[rid]
        return outputs

    def _fork(self, req: RequestState, parent: Sequence) -> None:
        """Start samples 1..n-1 on the parent's prompt pages (shared, not recomputed).

        The parent has just computed its whole prompt. Each child takes the parent's full
        prompt pages by reference and recomputes only the prompt's last partial page (at
        least its last token, whose logits it samples its own first token from).
        """
        for index in range(1, req.params.n):
            child = self._new_sequence(req.request_id, req.prompt_token_ids, req.params,
                                       index=index, arrival=parent.arrival,
                                       priority=parent.priority)
            self.scheduler.fork(parent, child)
            self.processor.track(req, child)

    def _record_prompt_logprobs(self, req: RequestState, first_pos: int,
                                logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens ``first_pos + 1 ...`` from the logits before them."""
        assert req.prompt_logprobs is not None
        known = len(req.prompt_logprobs)  # positions already recorded (recompute repeats)
        targets = req.prompt_token_ids[first_pos + 1 : first_pos + 1 + logits.shape[0]]
        skip = max(0, known - (first_pos + 1))
        if skip >= len(targets):
            return
        entries = compute_prompt_logprobs(logits[skip:], torch.tensor(targets[skip:]),
                                          req.params.prompt_logprobs)
        for target, lp in zip(targets[skip:], entries):
            req.prompt_logprobs.append(
                self.processor.token_logprobs(target, lp.logprob, lp.rank, lp.top))
