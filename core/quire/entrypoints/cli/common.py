"""What every subcommand shares: global options, the registry, user-facing errors."""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from quire.interfaces.platform import Platform
from quire.plugins.registry import (
    DISABLE_PLUGINS_ENV,
    PlatformRegistry,
    parse_plugin_names,
)


class UsageError(Exception):
    """The user asked for something impossible; ``main`` prints it and exits with 2."""


def add_global_options(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """Options every command takes, before or after the subcommand name."""
    parser.add_argument(
        "--disable-plugins",
        metavar="NAMES",
        default=default,
        help=f"comma-separated plugin names not to load (added to ${DISABLE_PLUGINS_ENV})",
    )


def blocked_plugins(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> frozenset[str]:
    """Plugin names blocked by ``--disable-plugins`` and the environment, together."""
    environ = os.environ if environ is None else environ
    from_env = parse_plugin_names(environ.get(DISABLE_PLUGINS_ENV))
    return from_env | parse_plugin_names(getattr(args, "disable_plugins", None))


def open_registry(args: argparse.Namespace) -> PlatformRegistry:
    """Discover plugins for this run. :raises UsageError: on a blocking or naming conflict."""
    try:
        return PlatformRegistry(blocked=blocked_plugins(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def resolve_device(registry: PlatformRegistry, device: str) -> Platform:
    """The platform for ``--device``. :raises UsageError: unknown, refused or unavailable."""
    try:
        return registry.resolve(device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
