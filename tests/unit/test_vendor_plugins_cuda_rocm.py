"""The cuda and rocm plugins without their hardware.

Each torch build is simulated by patching ``torch.version.cuda`` / ``torch.version.hip``
and ``torch.cuda``'s functions, so every availability reason is reached on a CPU-only
machine. The plugins need not be installed: their source directories are put on the path
(CI installs only the core); the entry points are read from their pyproject files.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces import MemoryProfiler, Platform
from quire.kernels import TritonAttentionBackend, TritonAttentionConfig
from quire.plugins.registry import ENTRY_POINT_GROUP, PlatformRegistry
from quire.plugins.spec import PLUGIN_API_VERSION

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
PLUGIN_DIRS = [str(PLUGINS / "cuda"), str(PLUGINS / "rocm")]
for _path in PLUGIN_DIRS:
    if _path not in sys.path:
        sys.path.append(_path)  # after site-packages: an installed copy wins

from quire_cuda import memory as cuda_memory  # noqa: E402
from quire_cuda import platform as cuda_platform  # noqa: E402
from quire_cuda import plugin as cuda_plugin  # noqa: E402
from quire_rocm import memory as rocm_memory  # noqa: E402
from quire_rocm import platform as rocm_platform  # noqa: E402
from quire_rocm import plugin as rocm_plugin  # noqa: E402

CudaPlatform = cuda_platform.CudaPlatform
RocmPlatform = rocm_platform.RocmPlatform


# -- simulated torch builds -----------------------------------------------------------------


def simulate(
    monkeypatch: pytest.MonkeyPatch,
    *,
    cuda: str | None = None,
    hip: str | None = None,
    devices: int | BaseException = 0,
    warning: str | None = None,
    triton: bool = True,
) -> None:
    """Patch torch's build, ``torch.cuda.device_count`` and whether triton is found."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)

    def device_count() -> int:
        if warning is not None:
            warnings.warn(warning, UserWarning, stacklevel=2)
        if isinstance(devices, BaseException):
            raise devices
        return devices

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    for module in (cuda_platform, rocm_platform):
        monkeypatch.setattr(module, "_triton_installed", lambda: triton)
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def reason(platform: Platform) -> str:
    availability = platform.availability()
    return "available" if availability else availability.reason


# -- the platform contract ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "name", "visible_env"),
    [(CudaPlatform, "cuda", "CUDA_VISIBLE_DEVICES"), (RocmPlatform, "rocm", "HIP_VISIBLE_DEVICES")],
)
def test_platform_attributes(cls: type[Platform], name: str, visible_env: str) -> None:
    platform = cls()
    assert isinstance(platform, Platform)
    assert platform.name == name
    assert platform.device_type == "cuda"  # ROCm torch reuses the cuda device type
    assert platform.visible_devices_env == visible_env
    assert platform.distributed_backend == "nccl"  # RCCL behind the same name on ROCm
    assert platform.supported_dtypes == (torch.bfloat16, torch.float16, torch.float32)
    assert platform.default_block_size == 16
    assert platform.priority == 100
    assert platform.device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="float64.*bfloat16, float16, float32"):
        platform.check_dtype(torch.float64)


# -- availability reasons -------------------------------------------------------------------


def test_cuda_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = CudaPlatform()
    simulate(monkeypatch)
    assert "was built without CUDA (torch.version.cuda is None)" in reason(cuda)
    simulate(monkeypatch, hip="6.2.41133")
    assert reason(cuda) == "this is a ROCm build of torch; use the rocm platform"
    simulate(monkeypatch, cuda="12.8", devices=0)
    assert reason(cuda) == "no CUDA device found"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert reason(cuda) == "no CUDA device found (CUDA_VISIBLE_DEVICES='')"
    simulate(monkeypatch, cuda="12.8", devices=0,
             warning="CUDA initialization: The NVIDIA driver on your system is too old")
    assert reason(cuda) == "driver error: The NVIDIA driver on your system is too old"
    simulate(monkeypatch, cuda="12.8", devices=RuntimeError("cudaErrorNoDevice"))
    assert reason(cuda) == "driver error: RuntimeError: cudaErrorNoDevice"
    simulate(monkeypatch, cuda="12.8", devices=2, triton=False)
    assert reason(cuda).startswith("triton is not installed")
    simulate(monkeypatch, cuda="12.8", devices=2)
    assert reason(cuda) == "available"


def test_rocm_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    rocm = RocmPlatform()
    simulate(monkeypatch)
    assert "was built without ROCm (torch.version.hip is None)" in reason(rocm)
    simulate(monkeypatch, cuda="12.8")
    assert reason(rocm) == "this is a CUDA build of torch; use the cuda platform"
    simulate(monkeypatch, hip="6.2.41133", devices=0)
    assert reason(rocm) == "no AMD GPU found"
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "7")
    assert reason(rocm) == "no AMD GPU found (HIP_VISIBLE_DEVICES='7')"
    simulate(monkeypatch, hip="6.2.41133", devices=0,
             warning="CUDA initialization: No HIP GPUs are available")
    assert reason(rocm) == "driver error: No HIP GPUs are available"
    simulate(monkeypatch, hip="6.2.41133", devices=1, triton=False)
    assert "pytorch-triton-rocm" in reason(rocm)
    simulate(monkeypatch, hip="6.2.41133", devices=1)
    assert reason(rocm) == "available"


@pytest.mark.parametrize(("build", "expected"), [
    ({"cuda": "12.8"}, ["cuda"]),
    ({"hip": "6.2.41133"}, ["rocm"]),
    ({}, []),
])
def test_at_most_one_of_cuda_and_rocm_is_available(
    build: dict[str, str], expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    simulate(monkeypatch, devices=1, **build)
    available = [p.name for p in (CudaPlatform(), RocmPlatform()) if p.availability()]
    assert available == expected


# -- factories ------------------------------------------------------------------------------


def fake_gpu(monkeypatch: pytest.MonkeyPatch, units: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda index: types.SimpleNamespace(multi_processor_count=units),
    )


def test_cuda_attention_backend_is_the_core_triton_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpu(monkeypatch, units=132)
    backend = CudaPlatform().make_attention_backend()
    assert type(backend) is TritonAttentionBackend
    assert backend.config.decode_split_target == 4 * 132


def test_rocm_attention_backend_uses_amd_launch_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpu(monkeypatch, units=304)
    backend = RocmPlatform().make_attention_backend()
    assert type(backend) is TritonAttentionBackend
    assert backend.config.decode_split_target == 4 * 304
    assert (backend.config.num_warps, backend.config.num_stages) == (4, 1)


@pytest.mark.parametrize("cls", [CudaPlatform, RocmPlatform])
def test_attention_backend_without_a_device_keeps_the_default_split(
    cls: type[Platform], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels-only conformance runs build the backend on a machine without the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = cls().make_attention_backend()
    assert type(backend) is TritonAttentionBackend
    assert backend.config.decode_split_target == TritonAttentionConfig().decode_split_target


@pytest.mark.parametrize("cls", [CudaPlatform, RocmPlatform])
def test_communicator_is_the_core_one_over_nccl(cls: type[Platform]) -> None:
    comm = cls().make_communicator()
    assert isinstance(comm, TorchDistributedCommunicator)
    assert comm.backend == "nccl" and (comm.rank, comm.world_size) == (0, 1)
    x = torch.ones(3)
    assert comm.all_reduce(x) is x  # world size 1 never touches torch.distributed
    with pytest.raises(ValueError, match="rank 0 of world size 1 has no peer"):
        comm.send(x, 1)  # point-to-point (plugin API 1.1) comes with the core's class


class FakeAllocator:
    """The torch.cuda memory functions the profilers read, over plain numbers."""

    def __init__(self) -> None:
        self.free, self.total = 30 << 30, 80 << 30
        self.reserved, self.allocated, self.peak = 6 << 30, 4 << 30, 5 << 30
        self.calls: list[tuple[str, object]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(name: str, result: object = None):
            def fn(device=None):
                self.calls.append((name, device))
                return result() if callable(result) else result
            return fn

        readings = {
            "mem_get_info": record("mem_get_info", lambda: (self.free, self.total)),
            "memory_reserved": record("reserved", lambda: self.reserved),
            "memory_allocated": record("allocated", lambda: self.allocated),
            "max_memory_allocated": record("peak", lambda: self.peak),
            "reset_peak_memory_stats": record("reset"),
            "synchronize": record("synchronize"),
        }
        for name, fn in readings.items():
            monkeypatch.setattr(torch.cuda, name, fn)


@pytest.mark.parametrize("cls", [CudaPlatform, RocmPlatform])
def test_memory_profiler_reads_torch_cuda(
    cls: type[Platform], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    profiler = cls().make_memory_profiler(device_index=1)
    assert isinstance(profiler, MemoryProfiler)
    assert profiler.total_memory() == 80 << 30
    # driver's free plus what torch caches unused (reserved - allocated)
    assert profiler.free_memory() == (30 << 30) + (2 << 30)
    assert all(device == torch.device("cuda", 1) for _, device in fake.calls)

    fake.calls.clear()
    profiler.reset_peak()
    assert [name for name, _ in fake.calls] == ["synchronize", "reset"]
    fake.calls.clear()
    assert profiler.peak_memory() == 5 << 30
    assert [name for name, _ in fake.calls] == ["synchronize", "peak"]

    def forward() -> None:
        fake.peak = 7 << 30

    assert profiler.profile(forward) == 2 << 30
    assert profiler.kv_budget(None, activation_peak=1 << 30) == int((32 << 30) * 0.9) - (1 << 30)


def test_rocm_and_cuda_profilers_are_separate_copies() -> None:
    """Plugins never import each other: each ships its own small profiler."""
    assert cuda_memory.CudaMemoryProfiler is not rocm_memory.RocmMemoryProfiler
    for module in (cuda_platform, cuda_memory, rocm_platform, rocm_memory):
        source = Path(module.__file__).read_text()
        other = "quire_rocm" if module.__name__.startswith("quire_cuda") else "quire_cuda"
        assert other not in source


# -- cheap, lazy imports --------------------------------------------------------------------

_IMPORT_PROBE = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = {paths!r}
    import torch

    calls = []

    def trap(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError("torch.cuda." + name + " called")
        return fn

    for name in ("device_count", "is_available", "init", "_lazy_init", "current_device",
                 "get_device_properties", "mem_get_info", "synchronize", "set_device"):
        setattr(torch.cuda, name, trap(name))

    import quire_cuda.plugin, quire_rocm.plugin
    after_import = sorted(m for m in sys.modules if m.split(".")[0] == "triton")
    specs = quire_cuda.plugin.quire_platforms() + quire_rocm.plugin.quire_platforms()
    platforms = [spec.factory() for spec in specs]
    names = [(p.name, p.device_type, p.priority) for p in platforms]
    print(json.dumps({{
        "names": names,
        "calls": calls,
        "triton_after_import": after_import,
        "triton_after_factory": sorted(m for m in sys.modules if m.split(".")[0] == "triton"),
        "kernels_imported": "quire.kernels.triton_attention" in sys.modules,
    }}))
    """
)


def test_plugin_import_and_factory_touch_neither_triton_nor_torch_cuda() -> None:
    """In a fresh interpreter: import both plugins, list and build their platforms."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE.format(paths=PLUGIN_DIRS)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["names"] == [["cuda", "cuda", 100], ["rocm", "cuda", 100]]
    assert report["calls"] == []
    assert report["triton_after_import"] == []
    assert report["triton_after_factory"] == []
    assert report["kernels_imported"] is False


# -- packaging and discovery ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("plugin", "distribution"), [("cuda", "quire-cuda"), ("rocm", "quire-rocm")]
)
def test_pyproject_declares_entry_point_and_depends_only_on_quire(
    plugin: str, distribution: str
) -> None:
    project = tomllib.loads((PLUGINS / plugin / "pyproject.toml").read_text())["project"]
    assert project["name"] == distribution
    assert project["dependencies"] == ["quire"]  # no torch pin, nothing that pulls one
    entry_points = project["entry-points"][ENTRY_POINT_GROUP]
    assert entry_points == {plugin: f"quire_{plugin}.plugin"}
    module = importlib.import_module(entry_points[plugin])
    (spec,) = module.quire_platforms()
    assert spec.name == plugin and spec.api_version == PLUGIN_API_VERSION


def _entry_point(name: str, module: object, dist: str) -> types.SimpleNamespace:
    """A stand-in for an installed entry point (what the registry reads)."""
    return types.SimpleNamespace(
        name=name, group=ENTRY_POINT_GROUP,
        dist=types.SimpleNamespace(name=dist, version="0.1.0"), load=lambda: module,
    )


def registry_with_gpu_plugins() -> PlatformRegistry:
    from quire.platforms.cpu import plugin as cpu_plugin

    return PlatformRegistry(entry_points=[
        _entry_point("cpu", cpu_plugin, "quire"),
        _entry_point("cuda", cuda_plugin, "quire-cuda"),
        _entry_point("rocm", rocm_plugin, "quire-rocm"),
    ])


@pytest.mark.parametrize(("build", "chosen"), [
    ({}, "cpu"),
    ({"cuda": "12.8"}, "cuda"),
    ({"hip": "6.2.41133"}, "rocm"),
])
def test_registry_auto_picks_the_gpu_platform_of_this_torch_build(
    build: dict[str, str], chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    simulate(monkeypatch, devices=1, **build)
    registry = registry_with_gpu_plugins()
    assert [e.name for e in registry.entries()] == ["cpu", "cuda", "rocm"]
    assert registry.auto_choice() == chosen
