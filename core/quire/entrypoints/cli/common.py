"""What every subcommand shares: global options, the registry, user-facing errors."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Mapping

from quire.interfaces.platform import Platform
from quire.plugins.registry import (
    DISABLE_PLUGINS_ENV,
    PlatformRegistry,
    parse_plugin_names,
)


class UsageError(Exception):
    """The user asked for something impossible; ``main`` prints it in one line after the
    command's name, argparse's way (``quire serve: error: --port: ...``), and exits with 2."""

    #: The command line's program and subcommands (``quire serve``), where known.
    prog: str | None = None


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
    """The platform for ``--device``.

    :raises UsageError: naming ``--device``: unknown, refused or unavailable.
    """
    try:
        return registry.resolve(device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--device: {exc}") from exc


def read_chat_template(path: str | None) -> str | None:
    """The Jinja text of ``--chat-template FILE`` (None without one), compiled here once
    so that a missing file or a syntax error is told before the model loads, not at the
    first chat request.

    :raises UsageError: naming ``--chat-template``: unreadable, empty, not Jinja.
    """
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--chat-template: cannot read {path}: "
                         f"{exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"--chat-template: {path} is not UTF-8 text") from exc
    if not text.strip():
        raise UsageError(f"--chat-template: {path} is empty")
    _compile_template(text, path)
    return text


def _compile_template(text: str, path: str) -> None:
    """Compile ``text`` as transformers does for ``apply_chat_template`` (its sandbox and
    extensions, so that a tag it accepts is accepted here). :raises UsageError:"""
    from jinja2 import TemplateSyntaxError

    try:  # private, but what apply_chat_template runs (transformers 4.43 and later)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _compile_jinja_template = ImmutableSandboxedEnvironment(
            extensions=["jinja2.ext.loopcontrols"]).from_string
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        raise UsageError(f"--chat-template: {path}, line {exc.lineno}: not a valid Jinja "
                         f"template: {exc.message}") from exc
