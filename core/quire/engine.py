"""The engine: builds the parts once, then runs schedule -> forward -> sample steps.

Build order: platform (from the registry), model config, resolved engine config,
tokenizer, model, KV cache sized by the platform's memory profiler, block manager,
scheduler, runner. One engine owns all of these; nothing is shared between engines.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from quire.block_manager import BlockManager
from quire.config import EngineConfig, ResolvedConfig
from quire.interfaces.attention import AttentionBackend
from quire.interfaces.memory import MemoryProfiler
from quire.interfaces.platform import Platform
from quire.model_runner import ModelRunner
from quire.model_store import resolve_model
from quire.models.compile import compile_model
from quire.models.interface import CausalLM
from quire.models.loader import load_model, load_model_config
from quire.output_processor import OutputProcessor, RequestState
from quire.outputs import RequestOutput, RequestOutputKind
from quire.plugins.registry import PlatformRegistry
from quire.sampler import Sampler, compute_prompt_logprobs
from quire.sampling_params import SamplingParams
from quire.scheduler import ScheduledSeq, Scheduler
from quire.sequence import Sequence
from quire.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape facts of the model's KV cache, on this rank."""

    num_layers: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def of(cls, model: CausalLM) -> "KVCacheSpec":
        return cls(model.num_layers, model.num_kv_heads, model.head_dim)


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
    """Turns requests into outputs, one step at a time. Not thread-safe."""

    def __init__(self, config: EngineConfig, registry: PlatformRegistry | None = None):
        registry = registry or PlatformRegistry()
        self.platform: Platform = registry.resolve(config.device)
        self.platform.configure_process()
        model_path = resolve_model(config.model)
        self.model_config = load_model_config(model_path)
        self.config: ResolvedConfig = config.resolve(
            model_max_len=_model_max_len(self.model_config),
            platform_block_size=self.platform.default_block_size,
            platform_dtype=self.platform.supported_dtypes[0],
        )
        self.platform.check_dtype(self.config.dtype)
        self.device = self.platform.device()
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config, model_path)
        self.vocab_size: int = self.model_config.vocab_size

        comm = self.platform.make_communicator()
        self.model, _ = load_model(model_path, comm, self.device, self.config.dtype,
                                   config=self.model_config,
                                   extra_models=registry.model_specs())
        self.model.eval()
        self.platform.prepare_model(self.model, compiled=config.compile)
        if config.compile:
            compile_model(self.model)
        backend = self.platform.make_attention_backend()
        self.kv_spec = KVCacheSpec.of(self.model)
        num_blocks = self._num_kv_blocks(backend)
        kv_caches = [
            backend.allocate_kv_cache(num_blocks, self.config.block_size,
                                      self.kv_spec.num_kv_heads, self.kv_spec.head_size,
                                      self.config.dtype, self.device)
            for _ in range(self.kv_spec.num_layers)
        ]
        self.block_manager = BlockManager(num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(self.model, backend, kv_caches, self.config.block_size,
                                  self.device)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
                               seed=config.seed)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                         self.config.max_model_len)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        logger.info(
            "engine ready: platform=%s dtype=%s block_size=%d kv_pages=%d (%d tokens)",
            self.platform.name, self.config.dtype, self.config.block_size, num_blocks,
            num_blocks * self.config.block_size,
        )

    # -- KV cache sizing -------------------------------------------------------------------
    def _bytes_per_block(self, backend: AttentionBackend) -> int:
        spec, bs = self.kv_spec, self.config.block_size
        elems = math.prod(backend.kv_cache_shape(1, bs, spec.num_kv_heads, spec.head_size))
        return elems * self.config.dtype.itemsize * spec.num_layers

    def _num_kv_blocks(self, backend: AttentionBackend) -> int:
        profiler = self.platform.make_memory_profiler()
        requested = self.config.engine.kv_cache_memory
        activation_peak = 0
        if not isinstance(requested, int):  # a share of free memory: leave room to run
            activation_peak = self._profile_activations(backend, profiler)
        budget = profiler.kv_budget(requested, activation_peak)
        num_blocks = profiler.num_kv_blocks(budget, self._bytes_per_block(backend))
        # Never more pages than max_num_seqs sequences of max_model_len tokens can hold:
        # a small model's default budget would otherwise be millions of pages that only
        # cost start-up time and bookkeeping memory.
        most = self.config.max_num_seqs * -(-self.config.max_model_len // self.config.block_size)
        return min(num_blocks, most)

    def _profile_activations(self, backend: AttentionBackend, profiler: MemoryProfiler) -> int:
        """Activation peak of the largest step; measured on the shorter forward the
        profiler asks for (``profile_tokens``) and scaled up linearly."""
        full = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        run = profiler.profile_tokens(full)
        peak = profiler.profile(lambda: self._profile_run(backend, run))
        return -(-peak * full // run)

    def _profile_run(self, backend: AttentionBackend, num_tokens: int) -> None:
        """One forward of ``num_tokens`` prompt tokens, on a throwaway cache."""
        bs = self.config.block_size
        num_blocks = -(-num_tokens // bs)
        spec = self.kv_spec
        caches = [backend.allocate_kv_cache(num_blocks, bs, spec.num_kv_heads, spec.head_size,
                                            self.config.dtype, self.device)
                  for _ in range(spec.num_layers)]
        seq = Sequence(seq_id=-1, request_id="profile", prompt_token_ids=[0] * num_tokens,
                       params=SamplingParams(max_tokens=1))
        seq.block_table = list(range(num_blocks))
        runner = ModelRunner(self.model, backend, caches, bs, self.device)
        runner.execute([ScheduledSeq(seq, 0, num_tokens)])
        self.platform.synchronize()

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request. Checks everything before anything is scheduled.

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
        seq = self._new_sequence(rid, tokens, params, index=0)
        self.scheduler.add(seq, self._max_kv_tokens(seq))
        req = RequestState(rid, prompt, tokens, params,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                           arrival_time=arrival_time)
        self.processor.track(req, seq)
        self._requests[rid] = req
        return rid

    def _new_sequence(self, rid: str, tokens: list[int], params: SamplingParams,
                      index: int, arrival: int | None = None) -> Sequence:
        seq_id = next(self._ids)
        # each sample gets its own parameters (n=1, a seeded request's seed + index)
        return Sequence(seq_id=seq_id, request_id=rid, prompt_token_ids=tokens,
                        params=params.for_sequence(index),
                        arrival=seq_id if arrival is None else arrival, index=index)

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
        self.platform.begin_step(sum(s.num_tokens for s in out.scheduled))
        result = self.runner.execute(out.scheduled)
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
                                       index=index, arrival=parent.arrival)
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


def _model_max_len(config: object) -> int:
    for name in ("max_position_embeddings", "max_seq_len", "n_positions"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError("the model config states no context length (max_position_embeddings)")
