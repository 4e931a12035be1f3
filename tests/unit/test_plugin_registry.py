"""Plugin discovery: fake entry points first, then real test distributions installed once.

The fakes follow pluggy's ``test_load_setuptools_instantiation``: objects with only what the
registry reads from ``importlib.metadata`` (``name``, ``group``, ``dist``, ``load()``), so
ordering, blocking and every refusal are tested without installing anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from quire.entrypoints.cli import main
from quire.interfaces.communicator import Communicator
from quire.interfaces.platform import Availability, Platform
from quire.plugins.hookspecs import hookimpl
from quire.plugins.registry import (
    DISABLE_PLUGINS_ENV,
    ENTRY_POINT_GROUP,
    PlatformRegistry,
    api_compatible,
    parse_plugin_names,
)
from quire.plugins.spec import PLUGIN_API_VERSION, ModelSpec, PlatformSpec

# -- fakes


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str = "1.0.0"


@dataclass
class FakeEntryPoint:
    name: str
    #: What load() returns; an exception instance is raised instead.
    target: object
    dist: FakeDist | None = FakeDist("quire-fake")
    group: str = ENTRY_POINT_GROUP
    #: Shared list that records the order of load() calls.
    loads: list[str] = field(default_factory=list)

    def load(self) -> object:
        self.loads.append(self.name)
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


class FakePlatform(Platform):
    device_type = "cpu"
    distributed_backend = "gloo"
    supported_dtypes = (torch.float32,)
    default_block_size = 16
    reason = ""

    def availability(self) -> Availability:
        return Availability.no(self.reason) if self.reason else Availability.yes()

    def make_attention_backend(self):  # type: ignore[override]
        raise NotImplementedError

    def make_communicator(self, rank: int = 0, world_size: int = 1):  # type: ignore[override]
        raise NotImplementedError

    def make_memory_profiler(self, device_index: int = 0):  # type: ignore[override]
        raise NotImplementedError


def platform(name: str, priority: int = 0, reason: str = "", api: str = "1.0") -> PlatformSpec:
    attrs = {"name": name, "priority": priority, "reason": reason}
    cls = type(f"Fake_{name}", (FakePlatform,), attrs)
    return PlatformSpec(name, api, cls, f"fake {name}")


def plugin(*specs: PlatformSpec, models: tuple[ModelSpec, ...] = ()) -> object:
    """A fresh plugin object each time: pluggy refuses one object under two names."""

    @hookimpl
    def quire_platforms() -> list[PlatformSpec]:
        return list(specs)

    @hookimpl
    def quire_model_architectures() -> list[ModelSpec]:
        return list(models)

    return types.SimpleNamespace(
        quire_platforms=quire_platforms, quire_model_architectures=quire_model_architectures
    )


def ep(
    name: str, *specs: PlatformSpec, dist: str = "quire-fake", version: str = "1.0.0"
) -> FakeEntryPoint:
    return FakeEntryPoint(name, plugin(*specs), FakeDist(dist, version))


def cpu_ep() -> FakeEntryPoint:
    return ep("cpu", platform("cpu"), dist="quire", version="0.1.0")


def never_built() -> Platform:
    raise AssertionError("this platform must not be built")


# -- discovery order and blocking


def test_loads_by_distribution_then_entry_point_name() -> None:
    loads: list[str] = []
    eps = [
        FakeEntryPoint("b", plugin(platform("b")), FakeDist("quire-zeta"), loads=loads),
        FakeEntryPoint("z", plugin(platform("z")), FakeDist("Quire-Alpha"), loads=loads),
        FakeEntryPoint("a", plugin(platform("a")), FakeDist("quire-zeta"), loads=loads),
        FakeEntryPoint("c", plugin(platform("c")), FakeDist("quire"), loads=loads),
    ]
    registry = PlatformRegistry(entry_points=eps)
    assert loads == ["c", "z", "a", "b"]
    assert [e.name for e in registry.entries()] == ["c", "z", "a", "b"]


def test_ignores_entry_points_of_other_groups() -> None:
    other = FakeEntryPoint("x", AssertionError("must not load"), group="console_scripts")
    registry = PlatformRegistry(entry_points=[cpu_ep(), other])
    assert [e.name for e in registry.entries()] == ["cpu"]
    assert other.loads == []


def test_blocked_plugin_is_neither_imported_nor_listed() -> None:
    never = AssertionError("must not load")
    blocked = FakeEntryPoint("vendor", never, FakeDist("quire-vendor", "2.0"))
    registry = PlatformRegistry(entry_points=[cpu_ep(), blocked], blocked={"vendor", "absent"})
    assert blocked.loads == []
    assert [e.name for e in registry.entries()] == ["cpu"]
    assert [(d.plugin, d.distribution, d.version) for d in registry.disabled()] == [
        ("vendor", "quire-vendor", "2.0")
    ]
    with pytest.raises(ValueError, match=r"plugin 'vendor' is disabled"):
        registry.resolve("vendor")


def test_blocking_the_essential_cpu_plugin_is_refused_before_loading() -> None:
    cpu = cpu_ep()
    with pytest.raises(ValueError, match=r"plugin 'cpu' is essential and cannot be disabled"):
        PlatformRegistry(entry_points=[cpu], blocked={"cpu", "other"})
    assert cpu.loads == []


@pytest.mark.parametrize(
    ("text", "names"),
    [(None, set()), ("", set()), ("cuda", {"cuda"}), (" cuda, rocm,,", {"cuda", "rocm"})],
)
def test_parse_plugin_names(text: str | None, names: set[str]) -> None:
    assert parse_plugin_names(text) == names


# -- plugin API version


@pytest.mark.parametrize(
    ("built_for", "provided", "ok"),
    [
        ("1.0", "1.0", True),
        ("1.0", "1.3", True),
        ("1.3", "1.3", True),
        ("1.3", "1.4", True),
        ("1.4", "1.3", False),
        ("1.4", "1.5", True),
        ("1.5", "1.4", False),
        ("1.6", "1.5", False),
        ("0.9", "1.0", False),
        ("2.0", "1.0", False),
        ("1", "1.0", False),
        ("1.0.0", "1.0", False),
        ("one.zero", "1.0", False),
        ("", "1.0", False),
    ],
)
def test_api_compatible(built_for: str, provided: str, ok: bool) -> None:
    assert api_compatible(built_for, provided) is ok


def test_incompatible_platform_is_listed_refused_and_names_both_versions() -> None:
    future = PlatformSpec("future", "99.0", never_built, "from the future")
    registry = PlatformRegistry(
        entry_points=[cpu_ep(), ep("futureplug", future, dist="quire-future", version="3.1.0")]
    )
    entry = next(e for e in registry.entries() if e.name == "future")
    assert entry.api_version == "99.0"
    assert entry.refused is not None
    for part in ("plugin 'futureplug'", "quire-future==3.1.0", "99.0", f"API {PLUGIN_API_VERSION}"):
        assert part in entry.refused
    for use in (registry.create, registry.availability, registry.resolve):
        with pytest.raises(ValueError) as excinfo:
            use("future")
        assert str(excinfo.value) == entry.refused
    assert registry.auto_choice() == "cpu"


def test_this_core_provides_api_1_6_and_keeps_plugins_built_for_1_0_to_1_5() -> None:
    """1.1 added Communicator.send/recv, 1.2 Platform.auto_dtype and details, 1.3 the
    quantised ops, 1.4 KV pages given back, 1.5 bfloat16 activations, 1.6 int8 KV pages
    in the Hadamard basis; a MINOR bump must not refuse older plugins, and an older
    platform gets the defaults (the reference quantized_linear, no w8a8, a backend that
    gives no memory back, float products, int8 pages refused at start)."""
    assert PLUGIN_API_VERSION == "1.6"
    registry = PlatformRegistry(entry_points=[
        ep("old", platform("old", api="1.0"), dist="quire-old"),
        ep("mid", platform("mid", api="1.1"), dist="quire-mid"),
        ep("prev", platform("prev", api="1.2"), dist="quire-prev"),
        ep("new", platform("new", api="1.3"), dist="quire-new"),
        ep("last", platform("last", api="1.4"), dist="quire-last"),
        ep("five", platform("five", api="1.5"), dist="quire-five"),
        ep("next", PlatformSpec("next", "1.7", never_built), dist="quire-next"),
    ])
    refused = {e.name: e.refused for e in registry.entries()}
    assert all(refused[name] is None for name in ("old", "mid", "prev", "new", "last", "five"))
    assert refused["next"] is not None
    assert "built for plugin API 1.7, but this Quire provides plugin API 1.6" in refused["next"]
    assert "built for plugin API 1.x (at most 1.6)" in refused["next"]
    last = registry.resolve("last")
    assert last.bf16_activations(True) is False
    assert last.settle_options({"x": 1}, dtype_auto=True) == {"x": 1}
    mid = registry.resolve("mid")
    assert mid.auto_dtype(torch.bfloat16) == mid.supported_dtypes[0]
    assert mid.auto_dtype(None) == mid.supported_dtypes[0]
    prev = registry.resolve("prev")
    assert "w8a8" not in prev.quantizations and "gguf" in prev.quantizations
    assert prev.make_ops().source_of("quantized_linear") == "reference"


def test_a_communicator_written_for_api_1_0_still_works_without_send_recv() -> None:
    """Its collectives run; send/recv raise NotImplementedError naming the API that added
    them, instead of the class failing to construct."""

    class CollectivesOnly(Communicator):
        rank, world_size = 0, 1

        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return tensor

        def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
            return tensor

        def barrier(self) -> None:
            pass

    comm = CollectivesOnly()
    x = torch.ones(2)
    assert comm.all_reduce(x) is x
    with pytest.raises(NotImplementedError, match=r"CollectivesOnly does not implement send"):
        comm.send(x, 1)
    with pytest.raises(NotImplementedError, match=r"recv\(\): .* plugin API 1\.1"):
        comm.recv(x, 1)


def test_malformed_api_version_is_refused() -> None:
    registry = PlatformRegistry(entry_points=[ep("odd", PlatformSpec("odd", "v1", never_built))])
    (entry,) = registry.entries()
    assert entry.refused is not None and "built for plugin API v1" in entry.refused


# -- conflicts and broken plugins


def test_two_platforms_with_one_name_name_both_distributions() -> None:
    eps = [
        ep("first", platform("gpu"), dist="quire-vendor-a", version="1.2"),
        ep("second", platform("gpu"), dist="quire-vendor-b", version="3.4"),
    ]
    with pytest.raises(ValueError) as excinfo:
        PlatformRegistry(entry_points=eps)
    message = str(excinfo.value)
    assert "platform 'gpu' is provided twice" in message
    assert "plugin 'first' (quire-vendor-a==1.2)" in message
    assert "plugin 'second' (quire-vendor-b==3.4)" in message


def test_two_plugins_with_one_entry_point_name_name_both_distributions() -> None:
    eps = [
        ep("gpu", platform("a"), dist="quire-vendor-a"),
        ep("gpu", platform("b"), dist="quire-vendor-b"),
    ]
    message = r"two plugins are named 'gpu'.*quire-vendor-a.*quire-vendor-b"
    with pytest.raises(ValueError, match=message):
        PlatformRegistry(entry_points=eps)


def test_plugin_that_fails_to_import_is_recorded_not_fatal() -> None:
    missing = ModuleNotFoundError("No module named 'vendorlib'")
    bad = FakeEntryPoint("vendor", missing, FakeDist("quire-vendor", "0.5"))
    registry = PlatformRegistry(entry_points=[cpu_ep(), bad])
    assert [e.name for e in registry.entries()] == ["cpu"]
    (broken,) = registry.broken()
    assert (broken.plugin, broken.distribution, broken.version) == ("vendor", "quire-vendor", "0.5")
    assert broken.error == "failed to load: ModuleNotFoundError: No module named 'vendorlib'"
    with pytest.raises(ValueError, match=r"unknown device 'vendor'.*No module named 'vendorlib'"):
        registry.resolve("vendor")


def test_plugin_whose_hook_raises_or_answers_garbage_is_recorded() -> None:
    @hookimpl
    def quire_platforms() -> list[PlatformSpec]:
        raise RuntimeError("driver table missing")

    raising = FakeEntryPoint("raising", types.SimpleNamespace(quire_platforms=quire_platforms))
    eps = [
        cpu_ep(),
        raising,
        ep("garbage", "not a spec"),  # type: ignore[arg-type]
        ep("upper", platform("GPU")),
        ep("auto", platform("auto")),
    ]
    registry = PlatformRegistry(entry_points=eps)
    assert [e.name for e in registry.entries()] == ["cpu"]
    errors = {b.plugin: b.error for b in registry.broken()}
    assert errors["raising"] == "quire_platforms() raised RuntimeError: driver table missing"
    assert "not a PlatformSpec" in errors["garbage"]
    assert "'GPU'" in errors["upper"] and "'auto'" in errors["auto"]


def test_plugin_breaking_in_its_model_hook_contributes_no_platform_either() -> None:
    @hookimpl
    def quire_platforms() -> list[PlatformSpec]:
        return [platform("gpu")]

    @hookimpl
    def quire_model_architectures() -> list[ModelSpec]:
        raise ImportError("vendor kernels missing")

    half = types.SimpleNamespace(
        quire_platforms=quire_platforms, quire_model_architectures=quire_model_architectures
    )
    registry = PlatformRegistry(entry_points=[cpu_ep(), FakeEntryPoint("half", half)])
    assert [e.name for e in registry.entries()] == ["cpu"]
    (broken,) = registry.broken()
    assert broken.error == "quire_model_architectures() raised ImportError: vendor kernels missing"


# -- using platforms


def test_listing_builds_no_platform_and_create_caches_per_registry() -> None:
    built: list[str] = []

    def factory() -> Platform:
        built.append("gpu")
        return platform("gpu").factory()

    def registry() -> PlatformRegistry:
        return PlatformRegistry(entry_points=[ep("gpu", PlatformSpec("gpu", "1.0", factory))])

    first, second = registry(), registry()
    assert [e.name for e in first.entries()] == ["gpu"] and built == []
    assert first.create("gpu") is first.create("gpu")
    assert second.create("gpu") is not first.create("gpu")
    assert built == ["gpu", "gpu"]


def test_auto_picks_highest_priority_available_platform() -> None:
    eps = [
        cpu_ep(),
        ep("fast", platform("fast", priority=5)),
        ep("fastest", platform("fastest", priority=9, reason="no device found")),
    ]
    registry = PlatformRegistry(entry_points=eps)
    assert registry.auto_choice() == "fast"
    assert registry.resolve("auto").name == "fast"


def test_auto_breaks_priority_ties_by_name() -> None:
    eps = [
        ep("b", platform("beta", priority=3)),
        ep("a", platform("alpha", priority=3), dist="quire-zzz"),
    ]
    assert PlatformRegistry(entry_points=eps).auto_choice() == "alpha"


def test_auto_with_nothing_available_gives_every_reason() -> None:
    registry = PlatformRegistry(entry_points=[ep("gpu", platform("gpu", reason="no device found"))])
    with pytest.raises(RuntimeError, match=r"no platform is available.*gpu: no device found"):
        registry.resolve("auto")


def test_explicit_unavailable_device_error_carries_reason() -> None:
    reason = "torch was built without CUDA"
    registry = PlatformRegistry(entry_points=[cpu_ep(), ep("gpu", platform("gpu", reason=reason))])
    assert registry.availability("gpu").reason == reason
    with pytest.raises(RuntimeError, match=f"device 'gpu' is not available: {reason}"):
        registry.resolve("gpu")
    assert registry.resolve("CPU").name == "cpu"


def test_unknown_device_lists_known_names() -> None:
    registry = PlatformRegistry(entry_points=[cpu_ep(), ep("gpu", platform("gpu"))])
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; known devices: auto, cpu, gpu"):
        registry.resolve("tpu")


def test_failing_factory_makes_platform_unavailable_with_plugin_named() -> None:
    gpu = ep("gpu", PlatformSpec("gpu", "1.0", never_built), dist="quire-gpu")
    registry = PlatformRegistry(entry_points=[cpu_ep(), gpu])
    reason = registry.availability("gpu").reason
    assert "platform 'gpu' from plugin 'gpu' (quire-gpu==1.0.0) failed to initialise" in reason
    assert "AssertionError" in reason
    assert registry.auto_choice() == "cpu"
    with pytest.raises(RuntimeError, match="failed to initialise"):
        registry.create("gpu")


def test_factory_building_a_platform_with_another_name_is_rejected() -> None:
    misnamed = PlatformSpec("gpu", "1.0", platform("cpu").factory)
    registry = PlatformRegistry(entry_points=[ep("gpu", misnamed)])
    with pytest.raises(RuntimeError, match=r"not a Platform named 'gpu'"):
        registry.create("gpu")


# -- model architectures


def test_model_specs_are_attributed_to_their_distribution() -> None:
    llama = ModelSpec("LlamaForCausalLM", lambda: torch.nn.Module)
    mixtral = ModelSpec("MixtralForCausalLM", lambda: torch.nn.Module)
    eps = [
        FakeEntryPoint("a", plugin(models=(llama,)), FakeDist("quire-a")),
        FakeEntryPoint("b", plugin(models=(mixtral,)), FakeDist("quire-b")),
    ]
    specs = PlatformRegistry(entry_points=eps).model_specs()
    assert specs == [(llama, "quire-a"), (mixtral, "quire-b")]


def test_two_models_for_one_architecture_name_both_distributions() -> None:
    llama = ModelSpec("LlamaForCausalLM", lambda: torch.nn.Module)
    eps = [
        FakeEntryPoint("a", plugin(models=(llama,)), FakeDist("quire-a")),
        FakeEntryPoint("b", plugin(models=(llama,)), FakeDist("quire-b")),
    ]
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM' is provided twice.*quire-a.*quire-b"):
        PlatformRegistry(entry_points=eps)


# -- integration: real distributions from tests/plugins, installed once per session

PLUGIN_SOURCES = Path(__file__).resolve().parents[1] / "plugins"


class PluginSites(NamedTuple):
    #: quire-testplatform and quire-badapi.
    main: Path
    #: quire-dupplatform alone, for the one test that wants the name conflict.
    duplicate: Path


@pytest.fixture(scope="session")
def plugin_sites(tmp_path_factory: pytest.TempPathFactory) -> PluginSites:
    work = tmp_path_factory.mktemp("quire-plugins")
    names = ("quire-testplatform", "quire-badapi", "quire-dupplatform")
    # Build from copies: an in-tree build writes build/ and *.egg-info beside the sources,
    # which concurrent test runs would race on.
    sources = [shutil.copytree(PLUGIN_SOURCES / name, work / "src" / name) for name in names]
    main_site, dup_site = work / "site", work / "site-dup"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    command += ["--no-build-isolation", "--target", str(main_site), *map(str, sources)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"installing the test plugins failed:\n{result.stdout}\n{result.stderr}")
    # One pip run for all three; the duplicate then moves to its own directory.
    dup_site.mkdir()
    for path in main_site.glob("quire_dupplatform*"):
        path.rename(dup_site / path.name)
    return PluginSites(main_site, dup_site)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_PLUGINS_ENV, raising=False)


def _row(output: str, platform_name: str) -> str:
    rows = [line for line in output.splitlines() if line.split(" ", 1)[0] == platform_name]
    assert len(rows) == 1, output
    return rows[0]


def test_cli_lists_installed_plugins(plugin_sites: PluginSites) -> None:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_PLUGINS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_sites.main), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "quire.entrypoints.cli", "plugins"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "quire==" in _row(out, "cpu") and _row(out, "cpu").endswith("  available")
    testdev = _row(out, "testdev")
    assert "quire-testplatform==0.1.0" in testdev and testdev.endswith("  available")
    assert _row(out, "testdev-absent").endswith("  unavailable: no test device attached")
    badapi = _row(out, "badapi")
    assert "quire-badapi==0.3.0" in badapi and "refused: plugin 'badapi'" in badapi
    assert "built for plugin API 99.0" in badapi
    assert f"provides plugin API {PLUGIN_API_VERSION}" in badapi
    assert out.splitlines()[-1] == "--device auto would choose: testdev"


def test_registry_resolves_installed_plugin(
    plugin_sites: PluginSites, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(plugin_sites.main))
    registry = PlatformRegistry()
    testdev = registry.resolve("testdev")
    assert (testdev.name, testdev.device_type, testdev.priority) == ("testdev", "cpu", 5)
    assert registry.resolve("auto") is testdev
    testdev.make_attention_backend()  # the cpu platform's factories, reused
    with pytest.raises(RuntimeError, match="no test device attached"):
        registry.resolve("testdev-absent")


def test_duplicate_installed_platform_is_a_usage_error(
    plugin_sites: PluginSites,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_env: None,
) -> None:
    monkeypatch.syspath_prepend(str(plugin_sites.main))
    monkeypatch.syspath_prepend(str(plugin_sites.duplicate))
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quire plugins: error: platform 'testdev' is provided twice")
    assert "quire-dupplatform==0.2.0" in err and "quire-testplatform==0.1.0" in err
    # The remedy the message suggests works, before or after the subcommand.
    assert main(["plugins", "--disable-plugins", "dupplatform"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "--device auto would choose: testdev"
    monkeypatch.setenv(DISABLE_PLUGINS_ENV, "dupplatform")
    assert main(["--disable-plugins", "testdev", "plugins"]) == 0
    out = capsys.readouterr().out
    assert "disabled: plugin 'testdev' (quire-testplatform==0.1.0)" in out
    assert out.splitlines()[-1] == "--device auto would choose: cpu"
