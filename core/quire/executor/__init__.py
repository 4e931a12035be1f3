"""Executors: how the engine runs the ranks of its model.

``uni`` runs the only rank in the engine's process; ``mp`` runs one process per rank on
this node; ``ray`` runs one Ray actor per rank anywhere in a Ray cluster.
:func:`make_executor` picks by ``distributed_executor_backend`` (default: ``uni`` at world
size 1, ``mp`` above) after :func:`check_parallel` refused what cannot shard.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from quire.config import EngineConfig

if TYPE_CHECKING:  # the runner imports this package's messages; keep its import light
    import torch

    from quire.executor.abstract import Executor
    from quire.plugins.registry import PlatformRegistry

__all__ = ["check_parallel", "make_executor", "worker_config"]


def worker_config(config: EngineConfig, dtype: torch.dtype,
                  platform_options: dict[str, Any] | None = None) -> EngineConfig:
    """``config`` with the dtype the engine core settled made explicit, for its workers:
    what ``dtype="auto"`` means depends on the host (the cpu platform's bfloat16 needs
    the CPU's bfloat16 products), and ranks on different hosts must run at one dtype;
    likewise the platform options it settled (``Platform.settle_options``), when given."""
    changes: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    if platform_options is not None:
        changes["platform_options"] = platform_options
    return dataclasses.replace(config, **changes)


def make_executor(config: EngineConfig, registry: PlatformRegistry) -> Executor:
    """The executor ``config`` asks for, its workers started and their shards loaded."""
    backend = config.executor_backend
    if backend == "uni":
        from quire.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, registry)
    platform = registry.resolve(config.device)
    if backend == "ray":
        from quire.executor.ray_executor import RayExecutor

        return RayExecutor(config, config.world_size, platform)
    from quire.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, config.world_size, platform)


def check_parallel(config: EngineConfig, model_config: Any) -> None:
    """Refuse, at start and in one line naming the numbers, a split the model cannot take.

    :raises ValueError: when the query heads, the KV heads or the MLP width do not divide
        by ``tensor_parallel_size`` (KV heads may instead be replicated: ``tp`` a multiple
        of them), or ``pipeline_parallel_size`` exceeds the layers.
    """
    tp = config.tensor_parallel_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                         f"{heads} attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {kv_heads} KV "
                         f"heads, or be a multiple of them (each then replicated)")
    width = getattr(model_config, "intermediate_size", None)
    if width is not None and width % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's MLP width "
                         f"(intermediate_size={width})")
    layers = model_config.num_hidden_layers
    if config.pipeline_parallel_size > layers:
        raise ValueError(f"pipeline_parallel_size={config.pipeline_parallel_size} exceeds "
                         f"the model's {layers} layers")
