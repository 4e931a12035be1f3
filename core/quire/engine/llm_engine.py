"""``LLMEngine``: the engine's front. It tokenizes nothing and schedules nothing: it
hands token ids to an engine core (:mod:`quire.engine.core`), in this process or in its
own, and turns the core's tokens into outputs (detokenization, stop strings, logprob
texts; :mod:`quire.engine.output_processor`).

Build order: the core first (platform, model, executor and its workers, KV cache sized by
the smallest rank's memory, block manager, scheduler, sampler), then the front settles
the same ``ResolvedConfig`` from what the core reports and loads the tokenizer.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quire.config import EngineConfig, ResolvedConfig
from quire.engine.core import EngineCore, check_request
from quire.engine.core_client import CoreClient, InprocCoreClient
from quire.engine.messages import (
    CoreOutputs,
    CoreRequest,
    EngineStats,
    SeqUpdate,
    ThinkingTokens,
)
from quire.engine.output_processor import OutputProcessor, RequestState
from quire.hub import fetch_model
from quire.lora.adapter import expected_modules, load_adapter
from quire.lora.request import LoRARequest
from quire.model_store import model_path_of
from quire.models.loader import is_gguf, load_model_config
from quire.multimodal.inputs import MMItem, check_images
from quire.multimodal.processor import ImageInputs, takes_images
from quire.outputs import (
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from quire.plugins.registry import PlatformRegistry
from quire.sampling.bad_words import bad_words_token_ids
from quire.sampling_params import SamplingParams
from quire.structured.backend import GrammarBackend, make_grammar_backend
from quire.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["EngineStats", "LLMEngine"]

#: An embedding request runs no sampler; these parameters only size its K/V (the prompt).
_EMBED_PARAMS = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class _EmbedState:
    """The front's view of one embedding request until its vector comes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    first_scheduled_time: float | None = None

    def output(self, embedding: list[float], reason: str) -> EmbeddingRequestOutput:
        now = time.monotonic()
        return EmbeddingRequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, embedding, reason,
            metrics=RequestMetrics(self.arrival_time, self.first_scheduled_time,
                                   finished_time=now))


class LLMEngine:
    """Turns requests into outputs, one step at a time. Not thread-safe.

    :param client: the cores to drive; by default one :class:`EngineCore` built here, in
        this process, or with ``data_parallel_size > 1`` one core process per replica.

    Call :meth:`shutdown` (or let the ``LLM`` that owns it do so) to stop the cores and
    their worker processes.
    """

    def __init__(self, config: EngineConfig, registry: PlatformRegistry | None = None, *,
                 client: CoreClient | None = None):
        config = fetch_model(config)  # once, here: the cores find it in the cache
        model_path = model_path_of(config)
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        if client is None and config.data_parallel_size > 1:
            from quire.engine.core_proc import ProcCoreClient

            client = ProcCoreClient.start(config, registry.blocked if registry else frozenset())
        elif client is None:
            client = InprocCoreClient(EngineCore(config, registry, tokenizer=self.tokenizer))
        self.client = client
        info = client.info
        self.info = info
        self.config: ResolvedConfig = config.resolve(
            model_max_len=info.model_max_len, platform_block_size=info.platform_block_size,
            platform_dtype=getattr(torch, info.platform_dtype), model_task=info.task)
        #: ``generate`` or ``embed``: which of add_request / add_embed_request it takes.
        self.task: str = self.config.task
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.vocab_size: int = info.vocab_size
        self.processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, RequestState] = {}
        #: LoRA adapters checked so far: id -> path (an id keeps its path).
        self._loras: dict[int, str] = {}
        self._lora_targets: dict[str, tuple[int, int]] | None = None
        self._embeddings: dict[str, _EmbedState] = {}
        self._ids = itertools.count()
        self._stats: EngineStats | None = None
        self._grammars: GrammarBackend | None = None
        self._images: ImageInputs | None = None
        self._images_lock = threading.Lock()
        self._mm_config: Any = False  # not read yet

    @property
    def core(self) -> EngineCore:
        """The core, when it runs in this process (tests and benchmarks look inside)."""
        if not isinstance(self.client, InprocCoreClient):
            raise AttributeError("the engine core runs in another process")
        return self.client.core

    def grammars(self) -> GrammarBackend:
        """The grammar engine that checks requests' structured outputs (the in-process
        core's own, whose cache its matchers then hit; built here otherwise). Thread-safe:
        the server checks on its tokenizer threads, before the engine sees a request."""
        if self._grammars is None:
            if isinstance(self.client, InprocCoreClient):
                self._grammars = self.client.core.grammars()
            else:
                self._grammars = make_grammar_backend(self.tokenizer, self.vocab_size,
                                                      sorted(self.eos_token_ids))
        return self._grammars

    def shutdown(self) -> None:
        """Stop the cores and their workers; safe to call more than once."""
        self.client.shutdown()

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
        thinking: ThinkingTokens | None = None,
        lora_request: LoRARequest | None = None,
        mm: list[MMItem] | None = None,
    ) -> str:
        """Queue a request. Checks everything before anything is scheduled.

        :param mm: its images, from :meth:`image_inputs` (placeholders expanded in
            ``prompt_token_ids``).

        :param lora_request: the LoRA adapter to run with (``enable_lora``), checked
            against the base model here.

        :param thinking: a reasoning model's thinking markers: a grammar
            (``structured_outputs``) then holds only the answer after the thinking.

        :param priority: lower is admitted first (vLLM's name); equal priorities go first
            come, first served. Sample ``i`` of the request gets ``priority + i``.
        :raises ValueError: for an empty or too long prompt, a token id outside the
            vocabulary, parameters outside this engine's limits, a duplicate request id,
            or a request the KV cache could never hold.
        """
        if self.task == "embed":
            raise ValueError("this model serves embeddings (task='embed') and cannot "
                             "generate: use LLM.embed or POST /v1/embeddings")
        self._prepare_params(params)
        asked, params = params, params.best_of_samples()  # best_of > n: the samples to run
        arrival_time = time.monotonic()
        rid = self._new_id(request_id)
        tokens = check_request(rid, prompt_token_ids, params, self.config, self.vocab_size,
                               self.info.num_blocks)
        if params.structured_outputs is not None:
            self.grammars().check(params.structured_outputs)
        if lora_request is not None:
            self.check_lora(lora_request)
        if mm:
            check_images(rid, mm, len(tokens), self._image_config() is not None)
        self.client.add_request(CoreRequest(rid, tokens, params, arrival_time, priority,
                                            thinking=thinking, lora=lora_request,
                                            mm=mm or []))
        req = RequestState(rid, prompt, tokens, params,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                           arrival_time=arrival_time)
        if params is not asked:
            req.keep, req.hide_logprobs = asked.n, asked.logprobs is None
        self.processor.track(req, 0)
        self._requests[rid] = req
        return rid

    def _prepare_params(self, params: SamplingParams) -> None:
        """What the front settles in ``params`` with its tokenizer before the core sees
        them: ``bad_words`` as token sequences. Refuses logits processors the core cannot
        run (a core in another process).

        :raises ValueError: naming the field."""
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words,
                                                             self.tokenizer) or None
        if params.logits_processors and not isinstance(self.client, InprocCoreClient):
            raise ValueError("logits_processors run in the engine core's process: this "
                             "engine's cores run in other processes (data_parallel_size "
                             "> 1, or a server), so they cannot call them")

    def image_inputs(self) -> ImageInputs:
        """The model's image preprocessing (built on first use; thread-safe).

        :raises ValueError: for a model that takes no images."""
        if self._images is None:
            config = self._image_config()
            if config is None:
                raise ValueError("this model takes text only: it has no image input")
            with self._images_lock:
                if self._images is None:
                    self._images = ImageInputs(model_path_of(self.config.engine), config,
                                               self.config.engine.limit_mm_per_prompt)
        return self._images

    def _image_config(self) -> Any | None:
        """The model's config when it takes images, else None (read once)."""
        if self._mm_config is False:
            config = load_model_config(model_path_of(self.config.engine)) \
                if not is_gguf(model_path_of(self.config.engine)) else None
            self._mm_config = config if config is not None and takes_images(config) \
                else None
        return self._mm_config

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter this engine cannot run, before it is queued.

        :raises ValueError: one line: LoRA is off, the path is not an adapter, its rank
            exceeds ``max_lora_rank``, a target the base model lacks, or tensors of
            another base model.
        """
        engine = self.config.engine
        if not engine.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA "
                             "is disabled: start the engine with enable_lora=True "
                             "(--enable-lora)")
        known = self._loras.get(lora_request.lora_int_id)
        if known == lora_request.lora_path:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already "
                             f"{known!r}; give {lora_request.lora_path!r} another id")
        self.check_adapter(lora_request.lora_path)
        self._loras[lora_request.lora_int_id] = lora_request.lora_path

    def check_adapter(self, path: str) -> None:
        """Refuse a path that is not an adapter this engine's base model can run (it
        reads the adapter's files; any thread may call it).

        :raises ValueError: one line naming the problem, as :meth:`check_lora`."""
        engine = self.config.engine
        if self._lora_targets is None:  # the same dict whichever thread fills it first
            self._lora_targets = expected_modules(load_model_config(model_path_of(engine)))
        load_adapter(path, self._lora_targets, engine.max_lora_rank)

    def add_embed_request(self, prompt_token_ids: list[int], *, prompt: str | None = None,
                          request_id: str | None = None, priority: int = 0) -> str:
        """Queue a prompt whose pooled vector is wanted (an embedding model's request):
        computed in one step, nothing sampled, its pages freed at once.

        :raises ValueError: when this engine generates (``task='generate'``), for an empty
            prompt, one longer than ``max_model_len`` or the step's token budget, a token
            id outside the vocabulary, or a duplicate request id.
        """
        if self.task != "embed":
            raise ValueError("this model generates (task='generate'); to serve embeddings "
                             "start it with task='embed' (--task embed)")
        arrival_time = time.monotonic()
        rid = self._new_id(request_id)
        tokens = check_request(rid, prompt_token_ids, _EMBED_PARAMS, self.config,
                               self.vocab_size, self.info.num_blocks)
        self.client.add_request(CoreRequest(rid, tokens, _EMBED_PARAMS, arrival_time,
                                            priority))
        self._embeddings[rid] = _EmbedState(rid, prompt, tokens, arrival_time)
        return rid

    def _new_id(self, request_id: str | None) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests or rid in self._embeddings:
            raise ValueError(f"request id {rid!r} is already in use")
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """Stop a request now and free its pages; unknown or finished ids are ignored.

        :returns: the request's last output, finished with reason "abort", or None.
        """
        embed = self._embeddings.pop(request_id, None)
        if embed is not None:
            self.client.abort_requests([request_id])
            return embed.output([], "abort")
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.client.abort_requests([request_id])
        self.processor.abort(req)
        req.finished_time = time.monotonic()
        return self.processor.make_output(req)

    def check_health(self) -> None:
        """:raises WorkerDied: an engine core in another process died."""
        self.client.check_health()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._embeddings)

    def stats(self) -> EngineStats:
        """The core's queues and KV pool (summed over data-parallel replicas)."""
        return sum_stats(self.client.stats())

    def replica_stats(self) -> list[EngineStats]:
        """Each core's stats, by data-parallel rank."""
        return self.client.stats()

    def process_counts(self) -> dict[str, int]:
        """Live engine core and worker processes (the server adds its API servers)."""
        cores = self.client.live_cores()
        return {"engine_core": cores, "worker": self.info.worker_processes *
                (cores or len(self.client.stats()))}

    # -- the step --------------------------------------------------------------------------
    def step(self, final_only: bool = False, timeout: float = 0.1
             ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one step of the core (or, for cores in other processes, take what they
        produced, waiting at most ``timeout`` seconds); report every request that changed.

        :param final_only: report only requests that finished (skips building the
            cumulative outputs of running requests, which nobody reads offline), whatever
            each request's ``output_kind``.
        """
        result: list[RequestOutput | EmbeddingRequestOutput] = []
        # one output per request per core step, as from a core in this process, even
        # when several steps wait: a stream's backlog counts steps, whoever is behind
        for outputs in self.client.get_outputs(timeout):
            changed: dict[str, RequestState] = {}
            embedded: list[EmbeddingRequestOutput] = []
            self._apply(outputs, changed, embedded)
            result += self._outputs(changed, final_only)
            result += embedded
        return result

    def _outputs(self, changed: dict[str, RequestState],
                 final_only: bool) -> list[RequestOutput]:
        """What ``changed`` requests report, in their output kinds; finished ones leave."""
        result = []
        make_output, requests = self.processor.make_output, self._requests
        for rid, req in changed.items():
            finished = req.finished
            if finished:
                req.finished_time = time.monotonic()
                result.append(make_output(req, True))
                del requests[rid]
            elif not (final_only or req.params.output_kind is RequestOutputKind.FINAL_ONLY
                      or req.keep is not None):
                result.append(make_output(req, False))
        return result

    def _apply(self, outputs: CoreOutputs, changed: dict[str, RequestState],
               embedded: list[EmbeddingRequestOutput]) -> None:
        if outputs.error is not None:
            raise RuntimeError(f"engine core {outputs.engine} failed a step and aborted its "
                               f"requests: {outputs.error}")
        requests, embeddings = self._requests, self._embeddings
        for entry in outputs.prompt_logprobs:
            req = requests.get(entry.request_id)
            if req is None or req.prompt_logprobs is None:
                continue
            for lp in entry.entries:
                req.prompt_logprobs.append(self.processor.token_logprobs(lp))
        # per sequence per step: locals; a token sets first (once) and last token times
        append, now = self.processor.append, outputs.time
        for update in outputs.updates:
            rid = update.request_id
            if embeddings and rid in embeddings:
                embedded.append(self._embedded(update))
                continue
            req = requests.get(rid)
            if req is None:
                continue  # aborted here after the core sampled it
            if update.token_id >= 0:
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
            if append(req, update):
                self.client.stop_sequence(rid, update.index)
            changed[rid] = req
        for result in outputs.beams:  # beam search: one message at the end
            req = requests.get(result.request_id)
            if req is not None:
                req.first_token_time = req.first_token_time or now
                req.last_token_time = now
                self.processor.finish_beams(req, result)
                changed[result.request_id] = req
        for rid, why in outputs.refused:
            embed = embeddings.pop(rid, None)
            if embed is not None:
                logger.warning("the engine core refused request %s: %s", rid, why)
                embedded.append(embed.output([], "abort"))
                continue
            req = requests.get(rid)
            if req is not None:
                logger.warning("the engine core refused request %s: %s", rid, why)
                self.processor.abort(req)
                changed[rid] = req

    def _embedded(self, update: SeqUpdate) -> EmbeddingRequestOutput:
        """The finished output of an embedding request (its vector came with the finish)."""
        state = self._embeddings.pop(update.request_id)
        state.first_scheduled_time = update.first_scheduled_time
        if update.embedding is None:  # aborted in the core
            return state.output([], update.finish_reason or "abort")
        vector = np.frombuffer(update.embedding, dtype="<f4").tolist()
        return state.output(vector, update.finish_reason or "stop")


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """One snapshot for several replicas: counts added, KV usage over all their pages."""
    if len(stats) == 1:
        return stats[0]
    used = sum(s.num_used_blocks for s in stats)
    blocks = sum(s.num_blocks for s in stats)
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_usage=used / blocks if blocks else 0.0, num_used_blocks=used, num_blocks=blocks,
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_queries=sum(s.prefix_queries for s in stats),
        prefix_hits=sum(s.prefix_hits for s in stats),
        has_unfinished=any(s.has_unfinished for s in stats),
        peak_used_blocks=sum(s.peak_used_blocks for s in stats),
        num_requests=sum(s.num_requests for s in stats),
        spec_num_drafts=sum(s.spec_num_drafts for s in stats),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
        spec_accepted_per_pos=[sum(column) for column in itertools.zip_longest(
            *(s.spec_accepted_per_pos for s in stats), fillvalue=0)])
