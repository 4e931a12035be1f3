"""``Worker``: one rank's share of the model, its KV cache and its model runner.

Every executor runs one worker per rank: in the engine's own process (``uni``) or in a
process of its own (``mp``). A worker builds its platform from the registry, joins its
tensor-parallel group through the platform's communicator (the caller initialised the
``torch.distributed`` group for more than one rank), loads its shard of the weights, and
then answers three calls: how many KV pages its memory holds, make that many, run a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from quire.config import EngineConfig, ResolvedConfig, parse_dtype
from quire.executor.drafter import Drafter, EagleDrafter, StageProposals
from quire.executor.graphs import capture_sizes
from quire.executor.messages import StepItem
from quire.executor.model_runner import ModelRunner, StepLimits, StepResult
from quire.executor.profile_cache import ProfileCache, profile_key
from quire.heap import release_freed_heap
from quire.interfaces.attention import (
    QUANTIZED_KV_TORCH_DTYPES,
    AttentionBackend,
    check_kv_cache_dtype,
)
from quire.interfaces.communicator import Communicator
from quire.interfaces.memory import MemoryProfiler
from quire.interfaces.platform import Platform, configure_platform
from quire.lora.layers import LoRAManager
from quire.model_store import model_path_of, resolve_model
from quire.models.compile import compile_model
from quire.models.eagle import Eagle3Head, EagleHead, eagle3_aux_layers, load_eagle_head
from quire.models.gemma3 import Gemma3ForCausalLM
from quire.models.interface import CausalLM
from quire.models.layers.quantized import use_bfloat16_activations
from quire.models.llama import LlamaForCausalLM
from quire.models.loader import (
    checkpoint_dtype,
    checkpoint_quantization,
    is_gguf,
    load_model,
    load_model_config,
)
from quire.models.mimo import MiMoMTPHead, load_mtp_head
from quire.models.pipeline import PipelineLink, PipelineStage
from quire.models.pooling import (
    PoolingConfig,
    context_length,
    model_task,
    pooling_config,
)
from quire.ops import OpSet
from quire.plugins.registry import PlatformRegistry
from quire.quantization.methods import resolve_method
from quire.spec.config import HEAD_METHODS, SpeculativeConfig

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


def resolve_config(config: EngineConfig, platform: Platform) -> ResolvedConfig:
    """``config`` with the checkpoint's and the platform's defaults settled: the engine
    and every worker settle them the same way."""
    model_path = model_path_of(config)
    model_config = load_model_config(model_path)
    # asked only for dtype=auto: a worker handed the core's dtype (worker_config) would
    # otherwise log a choice of its own host's that it does not make
    dtype = parse_dtype(config.dtype) or platform.auto_dtype(checkpoint_dtype(model_config))
    quantization = resolve_method(
        config.quantization, gguf_file=is_gguf(model_path),
        checkpoint_quantization=None if is_gguf(model_path)  # its blocks are the file's
        else checkpoint_quantization(model_config),
        platform_name=platform.name, platform_methods=tuple(platform.quantizations),
        config=config.quantization_config)
    return config.resolve(model_max_len=context_length(model_path,
                                                       model_max_len(model_config)),
                          platform_block_size=platform.default_block_size,
                          platform_dtype=dtype, model_task=model_task(model_path, model_config),
                          quantization=quantization)


def model_max_len(config: object) -> int:
    """The context length a model config states."""
    for name in ("max_position_embeddings", "max_seq_len", "n_positions"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError("the model config states no context length (max_position_embeddings)")


def auto_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, bf16_products: bool,
                        backend: AttentionBackend) -> str:
    """``kv_cache_dtype`` with ``auto`` made ``bfloat16`` for a float32 model whose
    quantised products take bfloat16 activations, where the backend holds bfloat16
    pages: the keys and values then keep the precision the products already round to,
    in half the bytes (accuracy and speed: docs/quantization.md, "Activations"). Logged
    when taken; ``kv_cache_dtype=float32`` keeps float32 pages. Else unchanged."""
    if not (kv_cache_dtype == "auto" and bf16_products and model_dtype == torch.float32
            and "bfloat16" in backend.kv_cache_dtypes):
        return kv_cache_dtype
    logger.info("KV pages hold bfloat16: the quantised products take bfloat16 activations "
                "(kv_cache_dtype=float32 keeps float32 pages)")
    return "bfloat16"


class Worker:
    """One rank: platform, model shard, KV cache, runner. Not thread-safe."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 registry: PlatformRegistry | None = None, ranks_on_host: int = 1) -> None:
        """:param ranks_on_host: ranks of this replica on this host; when the device has
            no index (one pool for the host, like its RAM) they share its memory."""
        registry = registry or PlatformRegistry()
        self.rank = rank
        self.ranks_on_host = ranks_on_host
        self.platform: Platform = registry.resolve(config.device)
        configure_platform(self.platform, config)
        self.platform.configure_process()
        # what the device had free before this rank loaded anything (gpu_memory_utilization
        # counts what the rank holds from here on)
        self._free_at_start = self.platform.make_memory_profiler(rank).free_memory() \
            if config.gpu_memory_utilization is not None else 0
        model_path = model_path_of(config)
        model_config = load_model_config(model_path)
        self.config = resolve_config(config, self.platform)
        self.platform.check_dtype(self.config.dtype)
        self.device = self.platform.device(rank)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        stage_index, tp_rank = divmod(rank, tp)  # tensor-parallel ranks are adjacent
        spec_config = config.speculative_config
        #: An EAGLE (EAGLE-3) or MTP head, which runs where the target's hidden states and LM head
        #: are: on the last pipeline stage, which then keeps the embedding too.
        self.head_method = spec_config is not None and spec_config.method in HEAD_METHODS
        self.stage = (PipelineStage.of(stage_index, pp, model_config.num_hidden_layers,
                                       keeps_embedding=self.head_method
                                       and stage_index == pp - 1)
                      if pp > 1 else None)
        tp_comm, pp_comm = self._communicators(tp_rank, tp, stage_index, pp)
        self.ops: OpSet = self.platform.make_ops()
        self.model, _ = load_model(model_path, tp_comm, self.device, self.config.dtype,
                                   config=model_config, extra_models=registry.model_specs(),
                                   stage=self.stage, quantization=self.config.quantization,
                                   ops=self.ops)
        self.model.eval()
        aux_width = 0
        if self.stage is not None and spec_config is not None \
                and spec_config.method == "eagle3" and isinstance(self.model, LlamaForCausalLM):
            # every stage keeps the inputs of its share of the layers an EAGLE-3 head reads,
            # and hands them on with the hidden states to the last stage, where it runs
            assert spec_config.model is not None
            self.model.model.aux_layers = eagle3_aux_layers(
                load_model_config(resolve_model(spec_config.model)),
                model_config.num_hidden_layers)
            aux_width = 3 * model_config.hidden_size
        self.link = None if self.stage is None or pp_comm is None else PipelineLink(
            pp_comm, self.stage, model_config.hidden_size, self.config.dtype, self.device,
            aux_width)
        #: This rank's step replies carry the logits (the last stage's first rank).
        self.returns_logits = tp_rank == 0 and (self.stage is None or self.stage.is_last)
        bf16_products = not config.compile and self._use_bf16_products(self.model)
        self.platform.prepare_model(self.model, compiled=config.compile)
        if config.compile:
            compile_model(self.model)
        #: LoRA adapters' device slots and products (``enable_lora``), or None.
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(self.model, model_config, config.max_loras,
                                    config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.device,
                                    self.config.dtype, self.ops)
        self.backend: AttentionBackend = self.platform.make_attention_backend()
        self.kv_layer_ids: tuple[int, ...] = tuple(
            getattr(self.model, "kv_layer_ids", range(self.model.num_layers)))
        spec = KVCacheSpec.of(self.model)
        self.kv_spec = KVCacheSpec(len(self.kv_layer_ids), spec.num_kv_heads, spec.head_size)
        #: What the KV pages hold (``kv_cache_dtype``), refused here, at start, where this
        #: platform's backend does not take it.
        self.kv_dtype: torch.dtype = check_kv_cache_dtype(
            self.backend, self.platform.name,
            auto_kv_cache_dtype(config.kv_cache_dtype, self.config.dtype, bf16_products,
                                self.backend),
            self.config.dtype, spec.head_size)
        #: An embedding model's pooling (its runner returns vectors, not logits).
        self.pooling: PoolingConfig | None = (
            pooling_config(model_path, model_config, config.pooling)
            if self.config.task == "embed" else None)
        #: The draft model, EAGLE head or MTP head (speculative decoding with
        #: ``speculative_config.model`` or method ``mtp``), on the same ranks as the
        #: target (with pipeline stages, a draft model on the first stage's, where the
        #: step's tokens enter, a head on the last's), and its KV shape facts; None
        #: without one.
        self.draft_model: CausalLM | EagleHead | Eagle3Head | MiMoMTPHead | None = None
        self.draft_kv_spec: KVCacheSpec | None = None
        self.draft_kv_dtype: torch.dtype | None = None
        first_stage = self.stage is None or self.stage.is_first
        last_stage = self.stage is None or self.stage.is_last
        if spec_config is not None and spec_config.method == "draft_model" and first_stage:
            self._load_draft(spec_config, tp_comm, registry)
        elif spec_config is not None and spec_config.method in ("eagle", "eagle3") \
                and last_stage:
            self._load_eagle(spec_config, tp_comm)
        elif spec_config is not None and spec_config.method == "mtp" and last_stage:
            self._load_mtp(spec_config, tp_comm, model_path)
        #: This rank's step replies carry the draft model's proposals: the first stage's
        #: first rank, when that is not the rank with the logits (pipeline stages).
        self.returns_drafts = (tp_rank == 0 and self.draft_model is not None
                               and not self.returns_logits)
        self.runner: ModelRunner | None = None

    def _load_draft(self, spec: SpeculativeConfig, comm: Communicator,
                    registry: PlatformRegistry) -> None:
        """Load the draft model as the target is loaded: this rank's shard, at its own
        dtype and weight format when ``speculative_config`` names them."""
        assert spec.model is not None
        path = resolve_model(spec.model)
        draft_config = load_model_config(path)
        dtype = parse_dtype(spec.dtype) if spec.dtype is not None else self.config.dtype
        self.platform.check_dtype(dtype)
        quantization = resolve_method(
            spec.quantization, gguf_file=is_gguf(path),
            checkpoint_quantization=None if is_gguf(path)
            else checkpoint_quantization(draft_config),
            platform_name=self.platform.name,
            platform_methods=tuple(self.platform.quantizations))
        model, _ = load_model(path, comm, self.device, dtype, config=draft_config,
                              extra_models=registry.model_specs(),
                              quantization=quantization, ops=self.ops)
        model.eval()
        bf16_products = self._use_bf16_products(model)
        self.platform.prepare_model(model, compiled=False)
        layer_ids = tuple(getattr(model, "kv_layer_ids", range(model.num_layers)))
        if len(layer_ids) != model.num_layers:
            raise ValueError("speculative_config.model: a draft whose layers share K/V "
                             "is not supported")
        self.draft_model = model
        self.draft_kv_spec = KVCacheSpec.of(model)
        self.draft_kv_dtype = check_kv_cache_dtype(
            self.backend, self.platform.name,
            auto_kv_cache_dtype("auto", dtype, bf16_products, self.backend), dtype,
            model.head_dim)

    def _use_bf16_products(self, model: torch.nn.Module) -> bool:
        """Give ``model``'s weight-only quantised layers bfloat16 activations where the
        platform says so (``Platform.bf16_activations``; this worker's options were
        settled by the core): whether any layer takes them."""
        return (self.platform.bf16_activations(self.config.engine.dtype == "auto")
                and use_bfloat16_activations(model) > 0)

    def _load_eagle(self, spec: SpeculativeConfig, comm: Communicator) -> None:
        """Load an EAGLE (EAGLE-3) head over the target (it shares the target's embedding,
        and an EAGLE head its LM head), at the target's dtype unless
        ``speculative_config.dtype`` says."""
        assert spec.model is not None
        # Gemma 3 scales its embedding inside its model, where a head would not
        if not isinstance(self.model, LlamaForCausalLM) \
                or isinstance(self.model, Gemma3ForCausalLM):
            raise ValueError(f"speculative_config.method {spec.method!r} reads a "
                             "Llama-family target's hidden states; "
                             f"{type(self.model).__name__} is not one")
        dtype = parse_dtype(spec.dtype) if spec.dtype is not None else self.config.dtype
        self.platform.check_dtype(dtype)
        head = load_eagle_head(resolve_model(spec.model), comm, self.device, dtype,
                               self.model, eagle3=spec.method == "eagle3")
        self._use_head(head, dtype)

    def _load_mtp(self, spec: SpeculativeConfig, comm: Communicator, path: str) -> None:
        """Build the MTP head from the target checkpoint's own layers (it shares the
        target's embedding and LM head), at the target's dtype unless
        ``speculative_config.dtype`` says."""
        dtype = parse_dtype(spec.dtype) if spec.dtype is not None else self.config.dtype
        self.platform.check_dtype(dtype)
        head = load_mtp_head(path, comm, self.device, dtype, self.model)
        self._use_head(head, dtype)

    def _use_head(self, head: EagleHead | Eagle3Head | MiMoMTPHead, dtype: torch.dtype
                  ) -> None:
        """Keep ``head`` as the draft, with its KV shape facts."""
        self.draft_model = head
        self.draft_kv_spec = KVCacheSpec.of(head)
        self.draft_kv_dtype = check_kv_cache_dtype(self.backend, self.platform.name, "auto",
                                                   dtype, head.head_dim)

    def _communicators(self, tp_rank: int, tp: int, stage: int,
                       pp: int) -> tuple[Communicator, Communicator | None]:
        """The tensor-parallel group of this rank's stage, and the pipeline group of its
        tensor-parallel rank (None without stages). With both kinds of parallelism, every
        rank creates every subgroup, in the same order, as torch.distributed requires."""
        make = self.platform.make_communicator
        if pp == 1:
            return make(tp_rank, tp), None
        if tp == 1:
            return make(0, 1), make(stage, pp)
        import torch.distributed as dist

        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        pp_groups = [dist.new_group(list(range(t, tp * pp, tp))) for t in range(tp)]
        return (make(tp_rank, tp, group=tp_groups[stage]),
                make(stage, pp, group=pp_groups[tp_rank]))

    # -- KV cache sizing -------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """Bytes one KV page takes on this rank, over every layer."""
        spec, bs = self.kv_spec, self.config.block_size
        # the real bytes: quantised values and their scales (kv_cache_dtype)
        total = self.backend.kv_cache_bytes(1, bs, spec.num_kv_heads, spec.head_size,
                                            self.kv_dtype) * spec.num_layers
        draft = self.draft_kv_spec
        if draft is not None:  # the draft's K/V sits under the same page ids
            assert self.draft_kv_dtype is not None
            total += self.backend.kv_cache_bytes(1, bs, draft.num_kv_heads, draft.head_size,
                                                 self.draft_kv_dtype) * draft.num_layers
        return total

    def num_kv_blocks(self) -> int:
        """KV pages this rank's memory holds, after the largest step's activations."""
        profiler = self.platform.make_memory_profiler(self.rank)
        requested = self.config.engine.kv_cache_memory
        utilization = self.config.engine.gpu_memory_utilization
        activation_peak = 0
        if self.kv_spec.num_layers == 0:  # an encoder: pages are bookkeeping, no memory
            return self.config.max_num_seqs * -(-self.config.max_model_len
                                                // self.config.block_size)
        if not isinstance(requested, int):  # a share of free memory: leave room to run
            full = min(self.config.max_num_batched_tokens, self.config.max_model_len)
            run = profiler.profile_tokens(full)
            activation_peak = -(-self._activation_peak(profiler, run) * full // run)
        if utilization is not None:
            held = max(0, self._free_at_start - profiler.free_memory())
            budget = profiler.utilization_budget(float(utilization), held, activation_peak)
        else:
            budget = profiler.kv_budget(requested, activation_peak)
        if not isinstance(requested, int) and self.device.index is None:
            # a share of one pool that every rank here reads, and the data-parallel
            # replicas' ranks too (counted as if all ran here: safe whichever measures
            # first, since each takes a share of what it finds free)
            budget //= self.ranks_on_host * self.config.engine.data_parallel_size
        return profiler.num_kv_blocks(budget, self.bytes_per_block())

    def _activation_peak(self, profiler: MemoryProfiler, num_tokens: int) -> int:
        """How far a forward of ``num_tokens`` prompt tokens raises this rank's memory:
        measured once, then read from the profile cache while nothing that sets it
        changes (:mod:`quire.executor.profile_cache`)."""
        spec = self.config.engine.speculative_config
        models = [model_path_of(self.config.engine)]
        if spec is not None and spec.model is not None:
            models.append(resolve_model(spec.model))
        key = profile_key(self.config, model_paths=models, platform=self.platform,
                          rank=self.rank, world_size=self.config.engine.world_size,
                          ranks_on_host=self.ranks_on_host, tokens=num_tokens)
        cache = ProfileCache()
        peak = cache.get(key)
        if peak is None:
            peak = profiler.profile(lambda: self._profile_run(num_tokens))
            cache.put(key, peak)
        else:
            logger.debug("activation peak of %d tokens from the profile cache: %d bytes",
                         num_tokens, peak)
        return peak

    def _profile_run(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` prompt tokens, on a throwaway cache."""
        bs = self.config.block_size
        num_blocks = -(-num_tokens // bs)
        runner = ModelRunner(self.model, self.backend, self._allocate(num_blocks), bs,
                             self.device, self.link, self.ops, self.pooling,
                             drafter=self._drafter(num_blocks))
        runner.execute([StepItem(0, [0] * num_tokens, 0, list(range(num_blocks)), True)])
        self.platform.synchronize()

    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV pages per layer and the runner that uses them."""
        cfg = self.config
        limits = StepLimits(max_num_seqs=cfg.max_num_seqs,
                            max_num_tokens=cfg.max_num_batched_tokens,
                            max_pages=-(-cfg.max_model_len // cfg.block_size))
        self.runner = ModelRunner(self.model, self.backend, self._allocate(num_blocks),
                                  cfg.block_size, self.device, self.link, self.ops,
                                  self.pooling, limits, self._drafter(num_blocks, limits),
                                  self.lora)
        self._capture_graphs(self.runner)
        release_freed_heap()  # what loading freed (the GGUF metadata, the profile step)

    def _drafter(self, num_blocks: int, limits: StepLimits | None = None
                 ) -> Drafter | EagleDrafter | StageProposals | None:
        """The draft model's (or EAGLE head's) runner over ``num_blocks`` pages of its own
        K/V; on the first of several pipeline stages, the proposals of the head on the
        last; or None."""
        if self.draft_model is None:
            if self.head_method and self.link is not None and self.link.stage.is_first:
                return StageProposals(self.link)
            return None
        spec = self.draft_kv_spec
        assert spec is not None and self.draft_kv_dtype is not None
        caches: list[torch.Tensor | None] = [
            self.backend.allocate_kv_cache(num_blocks, self.config.block_size,
                                           spec.num_kv_heads, spec.head_size,
                                           self.draft_kv_dtype, self.device)
            for _ in range(spec.num_layers)]
        if isinstance(self.draft_model, (EagleHead, Eagle3Head, MiMoMTPHead)):
            return EagleDrafter(self.draft_model, self.backend, caches,
                                self.config.block_size, self.device, self.ops, limits,
                                link=self.link)  # on the last stage: sends to the first
        return Drafter(self.draft_model, self.backend, caches, self.config.block_size,
                       self.device, self.ops, limits)

    def _capture_graphs(self, runner: ModelRunner) -> None:
        """Capture the decode graphs when the platform records graphs and nothing turns
        them off: ``enforce_eager``, pipeline stages and embedding models (which run
        eagerly), or more than one rank (collectives inside a capture are untested).
        Logs the time and the device memory the capture took."""
        cfg = self.config
        if (cfg.engine.enforce_eager or self.link is not None or self.pooling is not None
                or cfg.engine.world_size > 1):
            return
        if self.kv_dtype in QUANTIZED_KV_TORCH_DTYPES:  # their KV write is not capturable
            return
        if isinstance(self.draft_model, Eagle3Head):  # it reads hidden states mid-model
            return
        if self.lora is not None:  # its products follow each step's adapters
            return
        capture = self.platform.graph_capture(self.rank)
        if capture is None:
            return
        profiler = self.platform.make_memory_profiler(self.rank)
        sizes = capture_sizes(cfg.max_num_seqs)
        free, start = profiler.free_memory(), time.perf_counter()
        runner.capture_graphs(capture, sizes, cfg.max_model_len)
        self.platform.synchronize()
        logger.info("captured decode graphs for %d batch sizes (1..%d) in %.2f s, using "
                    "%.1f MiB of device memory", len(sizes), sizes[-1],
                    time.perf_counter() - start, (free - profiler.free_memory()) / 2**20)

    def _allocate(self, num_blocks: int) -> list[torch.Tensor | None]:
        """One KV tensor per layer this rank holds, by global layer index."""
        spec = self.kv_spec
        held = set(self.kv_layer_ids)
        return [self.backend.allocate_kv_cache(num_blocks, self.config.block_size,
                                               spec.num_kv_heads, spec.head_size,
                                               self.kv_dtype, self.device)
                if layer in held else None
                for layer in range(self.model.num_layers)]

    def release_kv_pages(self, start: int, stop: int) -> None:
        """Give back the memory of pages ``[start, stop)`` in every KV tensor this rank
        holds (the draft model's too)."""
        if self.runner is None:
            return
        caches = list(self.runner.kv_caches)
        if self.runner.drafter is not None:
            caches += self.runner.drafter.kv_caches
        for cache in caches:
            if cache is not None:
                self.backend.release_kv_pages(cache, start, stop)

    # -- steps -----------------------------------------------------------------------------
    def execute(self, items: list[StepItem], released: Iterable[int] = (),
                sampled: torch.Tensor | None = None,
                free_pages: Sequence[int] = ()) -> StepResult:
        """One forward over ``items``, after forgetting the ``released`` sequences; every
        rank gets the whole logits (the LM head gathers the vocabulary). ``sampled``
        holds the pending tokens (:meth:`ModelRunner.execute`). ``free_pages``: (start,
        stop) pairs, flat, of pages whose memory goes back first (:meth:`release_kv_pages`,
        sent with the step by an executor whose workers live elsewhere)."""
        if self.runner is None:
            raise RuntimeError("init_cache must be called before the first step")
        for i in range(0, len(free_pages), 2):
            self.release_kv_pages(free_pages[i], free_pages[i + 1])
        self.platform.begin_step(sum(len(item.token_ids) for item in items))
        if sampled is None:
            return self.runner.execute(items, released)
        return self.runner.execute(items, released, sampled=sampled)
