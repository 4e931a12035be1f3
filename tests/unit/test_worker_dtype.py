"""``dtype="auto"`` is decided once, by the engine core: its workers, which may sit on
hosts whose CPUs differ (Ray), get the decision as an explicit dtype, and the platform
options that depend on the host or on ``dtype="auto"`` settled (``settle_options``)."""

from __future__ import annotations

import pytest
import torch
from quire.config import EngineConfig
from quire.engine import core as core_module
from quire.engine.core import EngineCore
from quire.executor import worker_config
from quire.executor.worker import resolve_config
from quire.platforms.cpu.platform import CpuPlatform


class _Bf16Host(CpuPlatform):
    """The cpu platform where the CPU has bfloat16 products."""

    def auto_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        return torch.bfloat16


class _Fp32Host(CpuPlatform):
    """The cpu platform where it has none."""

    def auto_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        return torch.float32


class _OneRegistry:
    """What the engine core asks of a registry, for one platform."""

    def __init__(self, platform: CpuPlatform) -> None:
        self.platform = platform

    def resolve(self, device: str) -> CpuPlatform:
        return self.platform


class _Stop(Exception):
    pass


def test_a_worker_on_another_host_runs_at_the_cores_dtype(tiny_checkpoint) -> None:
    config = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu")
    core_side = resolve_config(config, _Bf16Host())
    assert core_side.dtype == torch.bfloat16
    assert resolve_config(config, _Fp32Host()).dtype == torch.float32  # the disagreement
    sent = worker_config(config, core_side.dtype)
    assert resolve_config(sent, _Fp32Host()).dtype == torch.bfloat16
    assert sent.dtype == "bfloat16" and config.dtype == "auto"  # the user's stays auto
    explicit = EngineConfig(model=config.model, device="cpu", dtype="float16")
    assert worker_config(explicit, torch.float16) == explicit


def test_the_engine_core_hands_its_executor_the_dtype_it_settled(
        tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    given: list[EngineConfig] = []

    def make_executor(config: EngineConfig, registry: object) -> None:
        given.append(config)
        raise _Stop  # no workers: what they would be started with is the point

    monkeypatch.setattr(core_module, "make_executor", make_executor)
    config = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu",
                          tensor_parallel_size=2)
    with pytest.raises(_Stop):
        EngineCore(config, _OneRegistry(_Bf16Host()))  # type: ignore[arg-type]
    (sent,) = given
    assert sent.dtype == "bfloat16"
    assert resolve_config(sent, _Fp32Host()).dtype == torch.bfloat16
    # the cpu platform's activations=auto, settled on this host for a dtype left to auto
    settled = CpuPlatform().settle_options({}, dtype_auto=True)
    assert settled["activations"] in ("bfloat16", "dtype")
    assert sent == EngineConfig(**{**vars(config), "dtype": "bfloat16",
                                   "platform_options": settled})


class _Asked(CpuPlatform):
    """Counts what the worker asks it."""

    asked = 0

    def auto_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        type(self).asked += 1
        return torch.float32


def test_a_worker_handed_a_dtype_does_not_decide_one_of_its_own(tiny_checkpoint) -> None:
    """``auto_dtype`` logs its choice: a worker that makes none must not log one."""
    config = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu")
    _Asked.asked = 0
    assert resolve_config(worker_config(config, torch.bfloat16), _Asked()).dtype \
        == torch.bfloat16
    assert _Asked.asked == 0
    assert resolve_config(config, _Asked()).dtype == torch.float32
    assert _Asked.asked == 1


def test_auto_kv_pages_follow_bfloat16_products_of_a_float32_model_only() -> None:
    """``kv_cache_dtype=auto`` becomes ``bfloat16`` only for a float32 model whose
    products take bfloat16 activations, on a backend with bfloat16 pages; any explicit
    choice, another model dtype, float32 products or a backend without bfloat16 pages
    leave it as it is."""
    from quire.executor.worker import auto_kv_cache_dtype

    class Backend:
        kv_cache_dtypes = ("float32", "bfloat16")

    class Int8Only:
        kv_cache_dtypes = ("int8",)

    f32, bf16 = torch.float32, torch.bfloat16
    assert auto_kv_cache_dtype("auto", f32, True, Backend()) == "bfloat16"
    assert auto_kv_cache_dtype("auto", f32, False, Backend()) == "auto"
    assert auto_kv_cache_dtype("auto", bf16, True, Backend()) == "auto"
    assert auto_kv_cache_dtype("auto", f32, True, Int8Only()) == "auto"
    for explicit in ("float32", "int8", "fp8", "bfloat16"):
        assert auto_kv_cache_dtype(explicit, f32, True, Backend()) == explicit
