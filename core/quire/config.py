"""Engine configuration: typed, frozen dataclasses checked when created.

``EngineConfig`` holds what a user chooses (keyword arguments of ``LLM``, later CLI flags
and YAML keys, with vLLM's names where vLLM has one). Values that depend on the checkpoint
or the platform (``block_size=None``, ``max_model_len=None``, ``dtype="auto"``) are
resolved once, by :meth:`EngineConfig.resolve`, into a :class:`ResolvedConfig`; nothing
mutates a config after creation.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from quire.quantization.methods import (
    GROUPED_METHODS,
    Quantization,
    QuantizationConfig,
    check_method,
)
from quire.spec.config import SpeculativeConfig

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype | None:
    """Map a dtype name to ``torch.dtype``; ``"auto"`` gives None.

    :raises ValueError: naming the accepted names.
    """
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        return None
    try:
        return _DTYPES[value]
    except KeyError:
        raise ValueError(
            f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {value!r}"
        ) from None


#: ``distributed_executor_backend`` values (vLLM's names).
_EXECUTORS = ("uni", "mp", "ray")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """What the user asks of the engine. Checked on creation; raises ``ValueError``."""

    model: str = field(metadata=_help("Hugging Face checkpoint directory, .gguf file, or "
                                      "Hub repo id (org/name, org/name:file.gguf)"))
    revision: str | None = field(
        default=None, metadata=_help("a Hub model's branch, tag or commit (default: main)"))
    gguf_file: str | None = field(
        default=None, metadata=_help("the .gguf file to load from a Hub repo or a local "
                                     "directory (or model org/name:file.gguf) (default: "
                                     "none: the repo's or directory's transformers "
                                     "checkpoint)"))
    tokenizer: str | None = field(
        default=None, metadata=_help("tokenizer directory (default: the model's)")
    )
    device: str = field(default="auto", metadata=_help("platform name, or 'auto'"))
    dtype: str = field(
        default="auto", metadata=_help("float32, bfloat16, float16, or auto (the platform's)")
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help("what the KV pages hold: auto (the model dtype; bfloat16 for a float32 "
                       "model whose quantised products take bfloat16 activations), float32, "
                       "bfloat16, int8 or fp8 (e4m3; both with a float16 scale per 16 values "
                       "of a token's KV head)"))
    quantization: str | None = field(
        default=None,
        metadata=_help("how weights are kept: gguf (a GGUF file's blocks as stored), int8 "
                       "(weight-only, quantised on load, a scale per 32 weights of a row: "
                       "see quantization_config), w8a8 (int8 weights as int8's and int8 "
                       "activations per token, a scale per 32 values), fp8 (e4m3 weights, "
                       "a scale per output channel), none (the model dtype) (default: gguf "
                       "for a .gguf file, none otherwise)"))
    #: Given as a dict or JSON text too; held as a :class:`QuantizationConfig`.
    quantization_config: QuantizationConfig | None = field(
        default=None,
        metadata=_help("how int8 and w8a8 quantise on load, as a JSON object: "
                       "'{\"group_size\": 32}' (a scale per 32 weights of a row, GGUF's "
                       "Q8_0 blocks; w8a8's activations per 32 values of a token) or "
                       "'{\"group_size\": -1}' (a scale per output row; w8a8's "
                       "activations per token); w8a8 also takes \"hadamard\": false "
                       "(weights and activations not turned by Hadamard groups of 32) "
                       "(default: group_size 32, hadamard true)"))
    block_size: int | None = field(
        default=None, metadata=_help("tokens per KV page (default: the platform's)")
    )
    max_num_seqs: int = field(default=256, metadata=_help("most sequences in one step"))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help("token budget of one step (default: 2048, at least max_model_len "
                       "without chunked prefill)"),
    )
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse cached KV pages"))
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("split long prompts across steps")
    )
    max_model_len: int | None = field(
        default=None, metadata=_help("context length (default: the model's)")
    )
    seed: int = field(default=0, metadata=_help("seed of the engine's random generator"))
    max_logprobs: int = field(
        default=20, metadata=_help("most logprobs or prompt_logprobs a request may ask for")
    )
    kv_cache_memory: int | float | None = field(
        default=None,
        metadata=_help("KV cache budget: bytes (int) or a fraction of free memory (float) "
                       "(default: the platform's share of free memory; cpu: 0.4 of it, at "
                       "most 8 GiB)"),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=_help("vLLM's memory option: the share of the device's total memory this "
                       "engine may hold on each rank (weights, activations and KV cache "
                       "together), in (0, 1]; the KV cache gets what is left. Instead of "
                       "kv_cache_memory; on the cpu platform, of the host's memory "
                       "(default: none, kv_cache_memory sizes the KV cache)"),
    )
    tensor_parallel_size: int = field(
        default=1, metadata=_help("ranks that split each layer (attention heads, MLP, "
                                  "vocabulary); one process each"))
    pipeline_parallel_size: int = field(
        default=1, metadata=_help("stages that split the layers; with "
                                  "tensor_parallel_size, each stage is that many ranks"))
    data_parallel_size: int = field(
        default=1, metadata=_help("engine replicas, each an engine core process with its "
                                  "own tensor x pipeline parallel ranks and KV cache; "
                                  "requests are placed by load and prompt prefix"))
    distributed_executor_backend: str | None = field(
        default=None, metadata=_help("how ranks run: 'uni' (in this process; world size 1 "
                                     "only), 'mp' (a process per rank on this node), "
                                     "'ray' (a Ray actor per rank, on any node of the "
                                     "cluster RAY_ADDRESS names, or a local one); default: "
                                     "uni for one rank, mp for more"))
    task: str = field(
        default="auto",
        metadata=_help("'generate', 'embed' (one pooled vector per prompt: LLM.embed, "
                       "/v1/embeddings), or 'auto': embed for encoders and "
                       "sentence-transformers directories, generate otherwise"))
    pooling: str | None = field(
        default=None,
        metadata=_help("an embedding model's pooling: 'mean', 'cls' or 'last' (default: "
                       "the sentence-transformers config's, else cls for encoders and "
                       "last for decoders)"))
    platform_options: dict[str, Any] | None = field(
        default=None,
        metadata=_help("the platform's own options, checked by the platform: "
                       "'key=value,key=value' (cpu: attention=sdpa|reference, "
                       "linear=packed|torch, compact=true|false, native=true|false, "
                       "threads=N, isa=LEVEL, wait_policy=auto|spin|passive, "
                       "kv_prefault=background|start|off, "
                       "decode_activations=auto|float32|bfloat16|int8, "
                       "activations=auto|dtype|bfloat16|int8) "
                       "(default: none, the platform's "
                       "defaults)"))
    compile: bool = field(
        default=False,
        metadata=_help("compile the model with torch.compile (Inductor): fewer kernels per "
                       "step, but minutes of compilation at the first start; on the cpu "
                       "platform it replaces the C kernels and is slower"),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_help("run every step eagerly: capture no device graphs of decode steps "
                       "(cuda and rocm capture them by default; other platforms have none)"),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help("vLLM's --async-scheduling: schedule and submit the next step "
                       "before the current step's sampled tokens reach the host, so the "
                       "host's work overlaps the device's (same outputs); not with "
                       "pipeline_parallel_size > 1; an embedding model runs synchronously, "
                       "and so do steps while speculative drafts are due; untested on a "
                       "GPU, and no gain on the cpu platform"),
    )

    #: Given as a dict or JSON text too; held as a :class:`SpeculativeConfig` (the type
    #: names that alone, so that the config crosses processes as JSON).
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=_help("vLLM's speculative decoding, as a JSON object: "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                       "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (prompt "
                       "lookup) or '{\"model\": DRAFT, \"num_speculative_tokens\": 4}' (a "
                       "draft model with the target's vocabulary); outputs keep the "
                       "model's distribution at any temperature (default: none)"),
    )

    limit_mm_per_prompt: int = field(
        default=4,
        metadata=_help("images one prompt may carry (an image-text model; vLLM's "
                       "--limit-mm-per-prompt, which also takes '{\"image\": N}')"))
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_help("a directory whose files requests may name as file:// image URLs "
                       "(default: none; vLLM's name)"))
    allowed_media_domains: str | None = field(
        default=None,
        metadata=_help("comma-separated hosts image URLs may name; these may also be "
                       "private or loopback addresses (default: any public host)"))
    enable_lora: bool = field(
        default=False,
        metadata=_help("serve LoRA adapters in PEFT's format over the base model (vLLM's "
                       "--enable-lora): requests name one (LoRARequest), one step mixes "
                       "several; the platform's whole-layer kernels are off"))
    max_loras: int = field(
        default=1, metadata=_help("adapters one step may hold (the device slots)"))
    max_lora_rank: int = field(
        default=16, metadata=_help("the largest adapter rank served; slots are this wide"))
    max_cpu_loras: int | None = field(
        default=None, metadata=_help("adapters kept loaded in host memory (default: "
                                     "max_loras); others are read again from their path"))

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path")
        for name in ("revision", "gguf_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        parse_dtype(self.dtype)
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, int8, "
                             f"fp8, got {self.kv_cache_dtype!r}")
        check_method(self.quantization)
        if self.quantization_config is not None:
            object.__setattr__(self, "quantization_config",
                               QuantizationConfig.parse(self.quantization_config))
            if self.quantization not in GROUPED_METHODS:
                raise ValueError(f"quantization_config applies to quantization int8 or "
                                 f"w8a8, got quantization={self.quantization!r}")
            if not self.quantization_config.hadamard and self.quantization != "w8a8":
                raise ValueError(f"quantization_config.hadamard applies to quantization "
                                 f"w8a8, got quantization={self.quantization!r}")
        _positive("block_size", self.block_size, optional=True)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        _positive("max_model_len", self.max_model_len, optional=True)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        kv = self.kv_cache_memory
        if kv is not None:
            if isinstance(kv, bool) or not isinstance(kv, (int, float)):
                raise ValueError(f"kv_cache_memory must be bytes or a fraction, got {kv!r}")
            if isinstance(kv, float) and not 0.0 < kv <= 1.0:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv}")
            if isinstance(kv, int) and kv <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv}")
        gmu = self.gpu_memory_utilization
        if gmu is not None:
            if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) \
                    or not 0.0 < float(gmu) <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
            if kv is not None:
                raise ValueError("gpu_memory_utilization and kv_cache_memory both size the "
                                 "KV cache; give one")
        self._check_parallel()
        self._check_task()
        options = self.platform_options
        if options is not None and (not isinstance(options, dict)
                                    or not all(isinstance(k, str) for k in options)):
            raise ValueError(f"platform_options must map option names to values, got "
                             f"{options!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "compile",
                     "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative_config is not None and self.task == "embed":
            raise ValueError("speculative_config applies to generating models, not "
                             "task='embed'")
        self._check_lora()
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling cannot run with pipeline_parallel_size > 1 "
                             f"(got {self.pipeline_parallel_size}): a pipeline already keeps "
                             "several steps in flight; turn one of them off")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _positive("max_loras", self.max_loras)
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
        if not isinstance(self.limit_mm_per_prompt, int) or self.limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt must be an integer >= 0, got "
                             f"{self.limit_mm_per_prompt!r}")
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")
        if not self.enable_lora:
            return
        if self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora runs without pipeline stages so far: "
                             "pipeline_parallel_size must be 1")
        for name in ("speculative_config", "compile"):
            if getattr(self, name):
                raise ValueError(f"enable_lora cannot run with {name} yet")

    def _check_parallel(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in _EXECUTORS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(_EXECUTORS)}, got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; "
                             f"tensor_parallel_size x pipeline_parallel_size is "
                             f"{self.world_size}: use 'mp'")

    def _check_task(self) -> None:
        from quire.models.pooling import TASKS
        from quire.ops.pooling import POOLING_METHODS

        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got "
                             f"{self.pooling!r}")
        if self.pooling is not None and self.task == "generate":
            raise ValueError("pooling applies to embedding models; it cannot be given "
                             "with task='generate'")

    @property
    def world_size(self) -> int:
        """Ranks of one replica: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """``distributed_executor_backend``, or its default for the world size."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(model=model, **kwargs)

    def resolve(
        self, *, model_max_len: int, platform_block_size: int, platform_dtype: torch.dtype,
        model_task: str = "generate", quantization: Quantization | None = None,
    ) -> "ResolvedConfig":
        """Fill in what depends on the checkpoint and the platform.

        :param model_task: what ``task="auto"`` means for the checkpoint
            (:func:`quire.models.pooling.model_task`).
        :param quantization: the method settled for the checkpoint and the platform
            (:func:`quire.quantization.methods.resolve_method`); None: ``none``.
        :raises ValueError: when ``max_model_len`` exceeds the model's, or the token budget
            cannot hold one whole prompt without chunked prefill (an embedding model's
            prompts are refused one by one instead).
        """
        task = model_task if self.task == "auto" else self.task
        if self.pooling is not None and task != "embed":
            raise ValueError(f"pooling={self.pooling!r} applies to embedding models; this "
                             f"one generates (task='embed' serves it as one)")
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context of {model_max_len}"
            )
        # an embedding's prompt is never chunked: by default the budget holds the longest
        chunked = self.enable_chunked_prefill and task != "embed"
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if chunked else max(2048, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len and task != "embed":
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}; "
                "without chunked prefill the longest prompt could never be scheduled"
            )
        return ResolvedConfig(
            engine=self,
            dtype=parse_dtype(self.dtype) or platform_dtype,
            block_size=self.block_size or platform_block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            task=task,
            quantization=quantization or Quantization("none"),
        )


@dataclass(frozen=True)
class ResolvedConfig:
    """``EngineConfig`` with every default settled; what the engine's parts read."""

    engine: EngineConfig
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    #: ``generate`` or ``embed`` (``task="auto"`` settled by the checkpoint).
    task: str = "generate"
    #: how weights are kept (``quantization`` settled by the checkpoint and platform)
    quantization: Quantization = Quantization("none")

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    @property
    def enable_prefix_caching(self) -> bool:
        """Never for embeddings: pooling reads every prompt row, so each is computed."""
        return self.engine.enable_prefix_caching and self.task != "embed"

    @property
    def enable_chunked_prefill(self) -> bool:
        """Never for embeddings: a prompt is computed (and pooled) in one step."""
        return self.engine.enable_chunked_prefill and self.task != "embed"


def _positive(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
