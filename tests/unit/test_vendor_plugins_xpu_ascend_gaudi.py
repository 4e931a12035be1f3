"""The xpu, ascend and gaudi plugins without their hardware or vendor libraries.

None of Intel's or Huawei's libraries, nor their devices, exist here, so this checks what
can be checked: the distributions install and declare their entry points; importing and
listing them imports no vendor library; each platform explains precisely why it is
unavailable (library missing, no device, driver error), using stand-ins in
``sys.modules``; and each attention backend's glue code (metadata, argument mapping,
fallbacks, the Gaudi decode algorithm) passes the conformance kernel checks when the
vendor operators are replaced by plain-torch models of their documented behaviour.

That last part verifies our reading of the vendor docs only against itself: a misread
argument would be misread in the model too. Real verification needs the hardware.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from quire.conformance import CHECK_IDS, ConformanceOptions, Outcome, run_conformance
from quire.entrypoints.cli import main
from quire.ops.attention import ReferenceAttentionBackend
from quire.plugins.registry import DISABLE_PLUGINS_ENV
from quire.plugins.spec import PLUGIN_API_VERSION

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {  # device name -> (distribution, package, vendor top-level modules)
    "xpu": ("quire-xpu", "quire_xpu", ("intel_extension_for_pytorch",)),
    "ascend": ("quire-ascend", "quire_ascend", ("torch_npu",)),
    "gaudi": ("quire-gaudi", "quire_gaudi", ("habana_frameworks",)),
}
VENDOR_MODULES = ("intel_extension_for_pytorch", "torch_npu", "habana_frameworks", "triton")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three distributions installed (no dependencies) into a directory of their own."""
    work = tmp_path_factory.mktemp("vendor-plugins")
    # copies: an in-tree build writes build/ and *.egg-info beside the sources
    sources = [shutil.copytree(ROOT / "plugins" / name, work / "src" / name) for name in PLUGINS]
    site = work / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
               "--no-build-isolation", "--target", str(site), *map(str, sources)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                            check=False)
    if result.returncode != 0:
        pytest.fail(f"installing the plugins failed:\n{result.stdout}\n{result.stderr}")
    return site


@pytest.fixture(autouse=True)
def plugins_importable(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process tests import the packages from the test install, so they need no
    other install (an editable one, if present, serves modules already imported)."""
    monkeypatch.syspath_prepend(str(plugin_site))


# -- installed: metadata, discovery, no vendor import ----------------------------------------


def test_distributions_declare_entry_points_and_depend_only_on_quire(plugin_site: Path) -> None:
    installed = importlib.metadata.distributions(path=[str(plugin_site)])
    dists = {d.metadata["Name"]: d for d in installed}
    for device, (distribution, package, _) in PLUGINS.items():
        dist = dists[distribution]
        [ep] = [ep for ep in dist.entry_points if ep.group == "quire.platforms"]
        assert (ep.name, ep.value) == (device, f"{package}.plugin")
        assert dist.requires == ["quire"]  # no torch, no vendor library
        assert (plugin_site / package / "py.typed").is_file()
        (spec,) = importlib.import_module(f"{package}.plugin").quire_platforms()
        assert spec.api_version == PLUGIN_API_VERSION  # built for this core's API


_PROBE = textwrap.dedent("""
    import importlib.abc, json, sys
    VENDOR = {vendor!r}
    attempts = []

    class Recorder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in VENDOR:
                attempts.append(name)
            return None

    sys.meta_path.insert(0, Recorder())
    from quire.plugins.registry import PlatformRegistry
    registry = PlatformRegistry()
    found = {{}}
    for name in {devices!r}:
        platform = registry.create(name)
        entry = next(e for e in registry.entries() if e.name == name)
        found[name] = dict(
            distribution=entry.distribution,
            module=type(platform).__module__,
            file=sys.modules[type(platform).__module__].__file__,
            attributes=[platform.device_type, platform.visible_devices_env,
                        platform.distributed_backend, platform.default_block_size,
                        platform.priority, [str(d) for d in platform.supported_dtypes]],
        )
    before = list(attempts)
    reasons = {{name: registry.availability(name).reason for name in {devices!r}}}
    print(json.dumps(dict(found=found, before=before, after=attempts, reasons=reasons)))
""")


def test_installed_plugins_list_and_build_without_importing_vendor_code(
    plugin_site: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_PLUGINS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), env.get("PYTHONPATH", "")])
    script = _PROBE.format(vendor=VENDOR_MODULES, devices=tuple(PLUGINS))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.splitlines()[-1])
    assert probe["before"] == []  # discovery, factories, attributes: no vendor import
    assert probe["after"]  # availability() does look: the recorder works
    for device, (distribution, package, _) in PLUGINS.items():
        found = probe["found"][device]
        assert found["distribution"] == distribution
        assert found["file"].startswith(str(plugin_site / package))
        assert found["attributes"][4] == 100  # priority
    assert probe["found"]["xpu"]["attributes"][:4] == ["xpu", "ZE_AFFINITY_MASK", "xccl", 64]
    assert probe["found"]["ascend"]["attributes"][:4] == [
        "npu", "ASCEND_RT_VISIBLE_DEVICES", "hccl", 128]
    assert probe["found"]["gaudi"]["attributes"][:4] == [
        "hpu", "HABANA_VISIBLE_MODULES", "hccl", 128]
    assert "torch was built without XPU support" in probe["reasons"]["xpu"]
    assert probe["reasons"]["ascend"].startswith("torch_npu is not installed")
    assert probe["reasons"]["gaudi"].startswith("habana_frameworks is not installed")


def test_conformance_reports_not_available_for_each(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DISABLE_PLUGINS_ENV, raising=False)
    for device in PLUGINS:
        assert main(["conformance", "--device", device]) == 0
        out = capsys.readouterr().out
        assert "platform contract  pass" in out
        # every check but the platform contract needs the platform
        assert out.count("not available: ") == len(CHECK_IDS) - 1
        assert f"platform '{device}' is not available here: " in out
        assert main(["conformance", "--device", device, "--require-available",
                     "--check", "memory"]) == 1
        capsys.readouterr()


# -- availability reasons, with stand-ins for the vendor libraries ---------------------------


def _module(name: str, **attributes: object) -> ModuleType:
    module = ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    return module


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import <name>`` raise ``error``, as a library with a missing .so does."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name, self.error = name, error

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


def _counting(count: int | Exception):
    def device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    return device_count


def test_xpu_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire_xpu.platform import XpuPlatform

    monkeypatch.setattr(torch.version, "xpu", None, raising=False)
    assert "torch was built without XPU support" in XpuPlatform().availability().reason
    monkeypatch.setattr(torch.version, "xpu", "20250101")
    monkeypatch.setattr(torch.xpu, "device_count", _counting(0))
    monkeypatch.setenv("ZE_AFFINITY_MASK", "3")
    assert XpuPlatform().availability().reason.startswith(
        "no XPU device found (ZE_AFFINITY_MASK='3')")
    monkeypatch.setattr(torch.xpu, "device_count", _counting(RuntimeError("level zero: -1")))
    assert XpuPlatform().availability().reason == (
        "driver error: torch.xpu.device_count() raised RuntimeError: level zero: -1")
    monkeypatch.setattr(torch.xpu, "device_count", _counting(1))
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    assert XpuPlatform().availability().reason.startswith(
        "neither intel_extension_for_pytorch nor triton is installed")
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch",
                        _module("intel_extension_for_pytorch"))
    assert XpuPlatform().availability()


def test_ascend_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire_ascend.platform import AscendPlatform

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert AscendPlatform().availability().reason.startswith("torch_npu is not installed")
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(sys, "meta_path", [_FailingImport("torch_npu", OSError(
        "libascendcl.so: cannot open shared object file")), *sys.meta_path])
    assert AscendPlatform().availability().reason.startswith(
        "driver error: importing torch_npu raised OSError: libascendcl.so")
    cases = [
        (0, "no NPU device found; check 'npu-smi info' and ASCEND_RT_VISIBLE_DEVICES"),
        (RuntimeError("drvGetDevNum failed"),
         "driver error: torch_npu.npu.device_count() raised RuntimeError: drvGetDevNum failed"),
    ]
    for count, reason in cases:
        fake = _module("torch_npu", npu=SimpleNamespace(device_count=_counting(count)))
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        assert AscendPlatform().availability().reason == reason
    monkeypatch.setitem(sys.modules, "torch_npu",
                        _module("torch_npu", npu=SimpleNamespace(device_count=_counting(8))))
    assert AscendPlatform().availability()


def _fake_habana(monkeypatch: pytest.MonkeyPatch, count: int | Exception) -> None:
    hpu = _module("habana_frameworks.torch.hpu", device_count=_counting(count))
    hccl = _module("habana_frameworks.torch.distributed.hccl")
    dist = _module("habana_frameworks.torch.distributed", hccl=hccl)
    core = _module("habana_frameworks.torch.core")
    htorch = _module("habana_frameworks.torch", hpu=hpu, core=core, distributed=dist)
    for module in (_module("habana_frameworks", torch=htorch), htorch, core, dist, hccl, hpu):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_gaudi_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire_gaudi.platform import GaudiPlatform

    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    assert GaudiPlatform().availability().reason.startswith("habana_frameworks is not installed")
    _fake_habana(monkeypatch, 0)
    assert GaudiPlatform().availability().reason == (
        "no HPU device found; check 'hl-smi' and HABANA_VISIBLE_MODULES")
    _fake_habana(monkeypatch, RuntimeError("synStatus 26"))
    assert GaudiPlatform().availability().reason == (
        "driver error: habana_frameworks.torch.hpu.device_count() raised RuntimeError: "
        "synStatus 26")
    _fake_habana(monkeypatch, 8)
    assert GaudiPlatform().availability()


# -- the backends' glue, over plain-torch models of the vendor operators ---------------------


def _pages(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a [blocks, block_size, H, D] cache."""
    pos = torch.arange(length)
    return cache[table[pos // cache.shape[1]].long(), pos % cache.shape[1]]


def _attention(q, k, v, scale, left=-1, softcap=0.0):
    """q: the last len(q) tokens of a sequence with keys k, v (all [n, H, D]); causal,
    keys p - left .. p when left >= 0 (flash-attention's window), soft cap when > 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = torch.arange(len(k) - len(q), len(k))[:, None]
    j = torch.arange(len(k))[None, :]
    allowed = (j <= p) & ((j >= p - left) if left >= 0 else True)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _scatter(key, value, key_cache, value_cache, slots):
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots.long(), key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots.long(), value)


class FakeIpexPagedAttention:
    """IPEX's ``PagedAttention`` ops as documented (flash layout, flash-attention windows)."""

    @staticmethod
    def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
        _scatter(key, value, key_cache, value_cache, slot_mapping)

    @staticmethod
    def flash_attn_varlen_func(out, query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv,
                               max_seqlen_q, max_seqlen_kv, scale, is_causal, block_table,
                               alibi_slopes=None, window_size_left=-1, window_size_right=-1,
                               softcap=0.0):
        assert is_causal and alibi_slopes is None and window_size_right in (-1, 0)
        for i in range(len(cu_seqlens_q) - 1):
            rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
            length = int(cu_seqlens_kv[i + 1] - cu_seqlens_kv[i])
            k, v = (_pages(c, block_table[i], length) for c in (k_cache, v_cache))
            out[rows] = _attention(query[rows], k, v, scale, window_size_left, softcap)


class OldFakeIpexPagedAttention(FakeIpexPagedAttention):
    """An IPEX whose varlen kernel takes no soft cap."""

    @staticmethod
    def flash_attn_varlen_func(out, query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv,
                               max_seqlen_q, max_seqlen_kv, scale, is_causal, block_table,
                               alibi_slopes=None, window_size_left=-1, window_size_right=-1):
        FakeIpexPagedAttention.flash_attn_varlen_func(
            out, query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
            max_seqlen_kv, scale, is_causal, block_table, alibi_slopes, window_size_left,
            window_size_right)


class FakeTorchNpu:
    """torch_npu's attention operators as documented (TND layout, compressed mask)."""

    @staticmethod
    def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
        assert slot_indices.dtype == torch.int32
        _scatter(key, value, key_cache, value_cache, slot_indices)

    @staticmethod
    def _npu_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out):
        assert context_lens.device.type == "cpu" and context_lens.dtype == torch.int32
        assert (num_heads, num_kv_heads) == (query.shape[1], key_cache.shape[2])
        for i, length in enumerate(context_lens.tolist()):
            k, v = (_pages(c, block_table[i], length) for c in (key_cache, value_cache))
            out[i:i + 1] = _attention(query[i:i + 1], k, v, scale_value)

    @staticmethod
    def npu_fused_infer_attention_score(query, key, value, *, atten_mask, block_table,
                                        input_layout, block_size, actual_seq_lengths,
                                        actual_seq_lengths_kv, num_key_value_heads, num_heads,
                                        scale, sparse_mode, pre_tokens=2**31 - 1,
                                        next_tokens=2**31 - 1):
        assert input_layout == "TND" and atten_mask.shape == (2048, 2048)
        assert sparse_mode in (3, 4) and (sparse_mode == 3 or next_tokens == 0)
        shape = (*key.shape[:2], num_key_value_heads, key.shape[2] // num_key_value_heads)
        k_cache, v_cache = key.view(shape), value.view(shape)
        out, start = torch.empty_like(query), 0
        for i, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
            k, v = (_pages(c, block_table[i], length) for c in (k_cache, v_cache))
            left = pre_tokens if sparse_mode == 4 else -1
            out[start:end] = _attention(query[start:end], k, v, scale, left)
            start = end
        return out, None


class FakeFusedSDPA:
    """Gaudi's FusedSDPA as documented: torch's scaled_dot_product_attention, positionally."""

    @staticmethod
    def apply(query, key, value, attn_mask, dropout_p, is_causal, scale):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale)


def _kernel_checks(platform, dtype: torch.dtype) -> list:
    options = ConformanceOptions(kernels_only=True, checks=("kv-write", "attention"),
                                 dtypes=(dtype,), block_sizes=(16, 5))
    report = run_conformance(platform, options)
    assert report.mode == "kernels-only"
    return report.results


def _assert_all_pass(results: list) -> None:
    assert [r.outcome for r in results] == [Outcome.PASS] * len(results), \
        "\n".join(f"{r.label}: {r.result_text}" for r in results)


def _with_ipex(monkeypatch: pytest.MonkeyPatch, ops: type) -> None:
    llm = SimpleNamespace(modules=SimpleNamespace(PagedAttention=ops))
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch",
                        _module("intel_extension_for_pytorch", llm=llm, __version__="fake"))


def test_xpu_ipex_backend_passes_the_kernel_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire_xpu.platform import XpuPlatform

    _with_ipex(monkeypatch, FakeIpexPagedAttention)
    backend = XpuPlatform().make_attention_backend()
    assert backend.name == "xpu-ipex"
    _assert_all_pass(_kernel_checks(XpuPlatform(), torch.float16))


def test_xpu_falls_back_to_triton_per_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """An IPEX without a soft cap keeps its kernels for the rest; the Triton backend (the
    reference stands in: same layout) serves soft-capped layers."""
    from quire_xpu.attention import make_backend

    _with_ipex(monkeypatch, OldFakeIpexPagedAttention)
    triton = _module("quire.kernels.triton_backend", TritonAttentionBackend=ReferenceAttentionBackend)
    monkeypatch.setitem(sys.modules, "quire.kernels.triton_backend", triton)
    assert make_backend().name == "xpu-ipex+cpu-reference"
    from quire_xpu.platform import XpuPlatform

    _assert_all_pass(_kernel_checks(_with_backend(XpuPlatform, make_backend), torch.float16))

    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)
    assert isinstance(make_backend(), ReferenceAttentionBackend)  # no IPEX: Triton for everything
    monkeypatch.setitem(sys.modules, "quire.kernels.triton_backend", None)
    with pytest.raises(RuntimeError, match="IPEX cannot be imported.*Triton backend cannot"):
        make_backend()


def test_ascend_backend_passes_the_kernel_checks() -> None:
    from quire_ascend.attention import AscendAttentionBackend
    from quire_ascend.platform import AscendPlatform

    platform = _with_backend(AscendPlatform, lambda: AscendAttentionBackend(FakeTorchNpu))
    _assert_all_pass(_kernel_checks(platform, torch.float16))


def test_gaudi_backend_passes_the_kernel_checks() -> None:
    from quire_gaudi.attention import GaudiAttentionBackend
    from quire_gaudi.platform import GaudiPlatform

    platform = _with_backend(GaudiPlatform, lambda: GaudiAttentionBackend(FakeFusedSDPA))
    _assert_all_pass(_kernel_checks(platform, torch.float32))


def _with_backend(base: type, make):
    """An instance of the vendor platform ``base`` whose backend ``make()`` builds."""
    return type(base.__name__, (base,), {"make_attention_backend": lambda self: make()})()
