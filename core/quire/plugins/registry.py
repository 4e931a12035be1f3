"""Discovers platform plugins and answers which platform a run uses.

Loading order (written for users in docs/plugins.md, "Plugin discovery and loading order"):

1. The blocked names (``--disable-plugins`` and ``QUIRE_DISABLE_PLUGINS``, read by the
   caller and passed in) go to ``set_blocked`` before anything loads. Blocking an
   essential plugin (``cpu``) is a ``ValueError``.
2. Every entry point of the ``quire.platforms`` group, the core's own ``cpu`` included, is
   taken in order of distribution name (case-insensitive), then entry point name. Each
   one not blocked is imported and registered under its entry point name; one that fails
   to import is recorded as broken and the rest carry on.
3. Each plugin's ``quire_platforms`` and then ``quire_model_architectures`` is called, in
   that same order, so every spec is attributed to its distribution. A platform built for
   an incompatible plugin API is kept in the listing, refused.
4. Nothing overrides anything: two plugins with one name, two platforms with one device
   name, or two models for one architecture are errors naming both distributions. The
   order therefore fixes the listing and which conflict is reported, never who wins.

Nothing here imports vendor code: factories run only in :meth:`PlatformRegistry.create`.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import pluggy

from quire.interfaces.platform import Availability, Platform
from quire.plugins import hookspecs
from quire.plugins.spec import PLUGIN_API_VERSION, ModelSpec, PlatformSpec

#: The entry point group that plugins, and the core's cpu platform, register under.
ENTRY_POINT_GROUP = "quire.platforms"
#: Comma-separated plugin names to skip. Read by the CLI and ``LLM`` layers, never here.
DISABLE_PLUGINS_ENV = "QUIRE_DISABLE_PLUGINS"
#: Plugins that cannot be disabled: cpu is the reference platform and the last fallback.
ESSENTIAL_PLUGINS: tuple[str, ...] = ("cpu",)
#: The device name that asks the registry to choose.
AUTO = "auto"


class DistributionLike(Protocol):
    """What the registry reads from ``importlib.metadata.Distribution``."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...


class EntryPointLike(Protocol):
    """What the registry reads from ``importlib.metadata.EntryPoint`` (tests pass fakes)."""

    @property
    def name(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def dist(self) -> DistributionLike | None: ...

    def load(self) -> Any: ...


@dataclass(frozen=True)
class PluginInfo:
    """One installed plugin: its entry point name and the distribution that ships it."""

    #: Entry point name; the name pluggy registers it under and ``--disable-plugins`` takes.
    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"plugin '{self.plugin}' ({self.distribution}=={self.version})"


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed to import, register, or answer a hook; it contributes nothing."""

    plugin: str
    distribution: str
    version: str
    #: What went wrong, with the exception type and message.
    error: str


@dataclass(frozen=True)
class PlatformEntry:
    """One discovered platform, as ``quire plugins`` lists it."""

    #: Device name (``--device``).
    name: str
    #: Entry point name of the plugin that provides it.
    plugin: str
    distribution: str
    #: Version of ``distribution``.
    version: str
    #: Plugin API the platform was built for.
    api_version: str
    description: str
    #: Why the registry will not use this platform, or None when it may.
    refused: str | None = None


def parse_plugin_names(text: str | None) -> frozenset[str]:
    """Plugin names from a comma-separated list such as ``"cuda, rocm"``; blanks are dropped."""
    if not text:
        return frozenset()
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def api_compatible(built_for: str, provided: str = PLUGIN_API_VERSION) -> bool:
    """Whether a plugin built for API ``built_for`` runs on a core providing ``provided``.

    Compatible means the same MAJOR and a MINOR no newer than ours. Anything that is not
    ``"MAJOR.MINOR"`` is incompatible, so a malformed version is refused, not guessed at.
    """
    theirs, ours = _parse_api(built_for), _parse_api(provided)
    if theirs is None or ours is None:
        return False
    return theirs[0] == ours[0] and theirs[1] <= ours[1]


class PlatformRegistry:
    """The platforms installed plugins provide, discovered once at construction.

    Each registry owns its own plugin manager and caches; create one per ``LLM`` or CLI run
    and pass it along. Construction imports plugins but calls no platform factory.
    """

    def __init__(
        self,
        *,
        blocked: Iterable[str] = (),
        entry_points: Iterable[EntryPointLike] | None = None,
    ) -> None:
        """Discover plugins (see the module docstring for the order).

        :param blocked: entry point names to skip, e.g. from ``--disable-plugins``.
        :param entry_points: what to discover; default: the installed ``quire.platforms``
            entry points. Entries of other groups are ignored.
        :raises ValueError: an essential plugin is blocked, or two plugins, platforms or
            model architectures share a name (the message names both distributions).
        """
        self.blocked = frozenset(blocked)
        _check_not_essential(self.blocked)
        self._pm = pluggy.PluginManager("quire")
        self._pm.add_hookspecs(hookspecs)
        for name in sorted(self.blocked):
            self._pm.set_blocked(name)
        self._loaded: dict[str, PluginInfo] = {}
        self._disabled: list[PluginInfo] = []
        self._broken: list[BrokenPlugin] = []
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in _in_load_order(entry_points):
            self._load(ep)
        self._platforms: dict[str, tuple[PlatformSpec, PlatformEntry]] = {}
        self._models: dict[str, tuple[ModelSpec, PluginInfo]] = {}
        self._collect_specs()
        self._created: dict[str, Platform] = {}
        self._availability: dict[str, Availability] = {}

    # -- listing

    def entries(self) -> list[PlatformEntry]:
        """Every discovered platform, refused ones included, in loading order."""
        return [entry for _, entry in self._platforms.values()]

    def broken(self) -> list[BrokenPlugin]:
        """Plugins that were found but contribute nothing because they failed."""
        return list(self._broken)

    def disabled(self) -> list[PluginInfo]:
        """Installed plugins that were skipped because their name is blocked."""
        return list(self._disabled)

    def model_specs(self) -> list[tuple[ModelSpec, str]]:
        """Model architectures the plugins add, each with the distribution providing it."""
        return [(spec, info.distribution) for spec, info in self._models.values()]

    # -- using a platform

    def create(self, name: str) -> Platform:
        """The platform called ``name``; built on first use, then reused by this registry.

        Does not check availability (see :meth:`resolve`).

        :raises ValueError: ``name`` is unknown or refused.
        :raises RuntimeError: the factory failed, or built something other than a
            :class:`Platform` named ``name`` (the message names the plugin).
        """
        if name not in self._created:
            spec, entry = self._usable(name)
            self._created[name] = _build(spec, entry)
        return self._created[name]

    def availability(self, name: str) -> Availability:
        """Whether ``name`` can run here, probed once per registry. A platform whose
        factory or probe fails is unavailable, with that failure as the reason.

        :raises ValueError: ``name`` is unknown or refused.
        """
        if name not in self._availability:
            self._usable(name)
            try:
                platform = self.create(name)
            except RuntimeError as exc:
                self._availability[name] = Availability.no(str(exc))
            else:
                self._availability[name] = _probe(platform, self._platforms[name][1])
        return self._availability[name]

    def auto_choice(self) -> str:
        """The device ``--device auto`` picks: the available, non-refused platform with the
        highest :attr:`Platform.priority`; among equal priorities, the alphabetically first
        name (so the choice never depends on installation order).

        :raises RuntimeError: nothing is available, listing each platform's reason.
        """
        usable = [e.name for e in self.entries() if e.refused is None]
        available = [name for name in usable if self.availability(name)]
        if not available:
            reasons = "; ".join(f"{n}: {self.availability(n).reason}" for n in usable)
            raise RuntimeError(
                f"no platform is available for device 'auto' ({reasons or 'none installed'})"
            )
        return min(available, key=lambda name: (-self.create(name).priority, name))

    def resolve(self, device: str) -> Platform:
        """The platform for a ``--device`` value: ``"auto"`` or a platform name.

        :raises ValueError: the name is unknown (the message lists the known names) or
            refused (the message says why).
        :raises RuntimeError: the platform, or for ``"auto"`` every platform, is
            unavailable; the message carries the reason.
        """
        name = device.strip().lower()
        if name == AUTO:
            return self.create(self.auto_choice())
        available = self.availability(name)
        if not available:
            raise RuntimeError(f"device '{name}' is not available: {available.reason}")
        return self.create(name)

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The underlying manager, for hooks the registry does not wrap yet."""
        return self._pm

    # -- discovery (construction only)

    def _load(self, ep: EntryPointLike) -> None:
        info = _info_of(ep)
        if self._pm.is_blocked(ep.name):
            self._disabled.append(info)
            return
        if ep.name in self._loaded:
            raise ValueError(
                f"two plugins are named '{ep.name}': {self._loaded[ep.name]} and {info}; "
                f"uninstall {info.distribution} or {self._loaded[ep.name].distribution}"
            )
        try:
            self._pm.register(ep.load(), name=ep.name)
        except Exception as exc:  # one bad plugin must not take the others down; it is listed
            if self._pm.get_plugin(ep.name) is not None:
                self._pm.unregister(name=ep.name)
            self._broken.append(_broken(info, f"failed to load: {_describe(exc)}"))
            return
        self._loaded[ep.name] = info

    def _collect_specs(self) -> None:
        # Both hooks are asked before anything is kept, so a plugin that breaks in the
        # second contributes nothing from the first either.
        platforms = self._ask_each("quire_platforms", _platform_spec_problem)
        models = self._ask_each("quire_model_architectures", _model_spec_problem)
        for plugin, info in self._loaded.items():
            for spec in platforms.get(plugin, []):
                self._add_platform(spec, info)
            for spec in models.get(plugin, []):
                self._add_model(spec, info)

    def _ask_each(
        self, hook: str, problem_of: Callable[[object], str | None]
    ) -> dict[str, list[Any]]:
        """Call ``hook`` on each plugin alone, in loading order: plugin name -> its answer.

        pluggy's own call would merge the answers (last registered first) and lose who said
        what; calling each implementation keeps every spec attributed to its distribution.
        A plugin that raises or answers malformed specs is unregistered and listed broken.
        """
        order = list(self._loaded)
        impls = getattr(self._pm.hook, hook).get_hookimpls()
        answers: dict[str, list[Any]] = {}
        for impl in sorted(impls, key=lambda impl: order.index(impl.plugin_name)):
            info = self._loaded[impl.plugin_name]
            try:
                answer = impl.function() or []
            except Exception as exc:  # listed as broken, as for an import error
                self._mark_broken(info, f"{hook}() raised {_describe(exc)}")
                continue
            if isinstance(answer, (list, tuple)):
                problem = next(filter(None, map(problem_of, answer)), None)
            else:
                problem = f"{answer!r}, which is not a list"
            if problem is not None:
                self._mark_broken(info, f"{hook}() returned {problem}")
                continue
            answers[info.plugin] = list(answer)
        return answers

    def _add_platform(self, spec: PlatformSpec, info: PluginInfo) -> None:
        entry = _entry(spec, info)
        if spec.name in self._platforms:
            raise ValueError(_duplicate(self._platforms[spec.name][1], entry))
        self._platforms[spec.name] = (spec, entry)

    def _add_model(self, spec: ModelSpec, info: PluginInfo) -> None:
        if spec.architecture in self._models:
            first = self._models[spec.architecture][1]
            raise ValueError(
                f"model architecture '{spec.architecture}' is provided twice: by {first} "
                f"and by {info}; uninstall one of these distributions or disable one plugin "
                f"with --disable-plugins or {DISABLE_PLUGINS_ENV}"
            )
        self._models[spec.architecture] = (spec, info)

    def _mark_broken(self, info: PluginInfo, error: str) -> None:
        self._pm.unregister(name=info.plugin)
        del self._loaded[info.plugin]
        self._broken.append(_broken(info, error))

    def _usable(self, name: str) -> tuple[PlatformSpec, PlatformEntry]:
        if name not in self._platforms:
            raise ValueError(self._unknown(name))
        spec, entry = self._platforms[name]
        if entry.refused is not None:
            raise ValueError(entry.refused)
        return spec, entry

    def _unknown(self, name: str) -> str:
        known = ", ".join([AUTO, *self._platforms])
        message = f"unknown device '{name}'; known devices: {known}"
        if name in self.blocked:
            message += f" (plugin '{name}' is disabled: --disable-plugins, {DISABLE_PLUGINS_ENV})"
        for broken in self._broken:
            if broken.plugin == name:
                message += f" (plugin '{name}' from {broken.distribution}: {broken.error})"
        return message


# -- helpers: pure functions of their arguments


def _check_not_essential(blocked: frozenset[str]) -> None:
    for name in ESSENTIAL_PLUGINS:
        if name in blocked:
            raise ValueError(
                f"plugin '{name}' is essential and cannot be disabled "
                f"(check --disable-plugins and {DISABLE_PLUGINS_ENV})"
            )


def _in_load_order(entry_points: Iterable[EntryPointLike]) -> list[EntryPointLike]:
    ours = [ep for ep in entry_points if ep.group == ENTRY_POINT_GROUP]
    return sorted(ours, key=lambda ep: (_info_of(ep).distribution.casefold(), ep.name))


def _info_of(ep: EntryPointLike) -> PluginInfo:
    dist = ep.dist
    if dist is None:  # an EntryPoint built by hand, not read from installed metadata
        return PluginInfo(ep.name, "<unknown distribution>", "?")
    return PluginInfo(ep.name, dist.name, dist.version)


def _parse_api(version: object) -> tuple[int, int] | None:
    match = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    return (int(match[1]), int(match[2])) if match else None


def _entry(spec: PlatformSpec, info: PluginInfo) -> PlatformEntry:
    refused = None
    if not api_compatible(spec.api_version):
        major = PLUGIN_API_VERSION.split(".")[0]
        refused = (
            f"{info} provides platform '{spec.name}' built for plugin API "
            f"{spec.api_version}, but this Quire provides plugin API {PLUGIN_API_VERSION}; "
            f"install a release of {info.distribution} built for plugin API {major}.x "
            f"(at most {PLUGIN_API_VERSION})"
        )
    return PlatformEntry(
        name=spec.name,
        plugin=info.plugin,
        distribution=info.distribution,
        version=info.version,
        api_version=str(spec.api_version),
        description=spec.description,
        refused=refused,
    )


def _duplicate(first: PlatformEntry, second: PlatformEntry) -> str:
    return (
        f"platform '{first.name}' is provided twice: by {_source(first)} and by "
        f"{_source(second)}; uninstall one of these distributions or disable one plugin "
        f"with --disable-plugins or {DISABLE_PLUGINS_ENV}"
    )


def _source(entry: PlatformEntry) -> str:
    return str(PluginInfo(entry.plugin, entry.distribution, entry.version))


def _platform_spec_problem(item: object) -> str | None:
    if not isinstance(item, PlatformSpec):
        return f"{item!r}, which is not a PlatformSpec"
    if not item.name or item.name != item.name.lower() or item.name == AUTO:
        return f"platform name {item.name!r}; a name is non-empty, lower-case, not '{AUTO}'"
    return None


def _model_spec_problem(item: object) -> str | None:
    return None if isinstance(item, ModelSpec) else f"{item!r}, which is not a ModelSpec"


def _build(spec: PlatformSpec, entry: PlatformEntry) -> Platform:
    source = _source(entry)
    try:
        platform = spec.factory()
    except Exception as exc:  # reported with the plugin named, chained for the traceback
        raise RuntimeError(
            f"platform '{spec.name}' from {source} failed to initialise: {_describe(exc)}"
        ) from exc
    if not isinstance(platform, Platform) or platform.name != spec.name:
        raise RuntimeError(
            f"platform '{spec.name}' from {source}: its factory built {platform!r}, "
            f"not a Platform named '{spec.name}'"
        )
    return platform


def _probe(platform: Platform, entry: PlatformEntry) -> Availability:
    try:
        result = platform.availability()
    except Exception as exc:  # the contract says never raise; a bug becomes the reason shown
        return Availability.no(f"{_source(entry)}: availability() raised {_describe(exc)}")
    if not isinstance(result, Availability):
        return Availability.no(f"{_source(entry)}: availability() returned {result!r}")
    return result


def _broken(info: PluginInfo, error: str) -> BrokenPlugin:
    return BrokenPlugin(info.plugin, info.distribution, info.version, error)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
