"""Engine flags for every command that runs a model, generated from ``EngineConfig``.

One source of truth: a new ``EngineConfig`` field becomes a ``--flag`` with its help text,
and a bad value is reported naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from quire.config import EngineConfig
from quire.entrypoints.cli.common import UsageError
from quire.model_store import DEFAULT_MODEL


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def expand_bare_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with ``true`` after each bare boolean flag (``--enforce-eager``) that a
    word other than a boolean follows: argparse would otherwise take that word (a
    positional model name: ``quire serve --enforce-eager MODEL``) as the flag's value."""
    bare = set()
    stack = [parser]
    while stack:
        for action in stack.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.nargs == "?" and action.const is True and action.type is _parse_bool:
                bare.update(action.option_strings)
    out: list[str] = []
    for i, word in enumerate(argv):
        out.append(word)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if word in bare and following is not None and not following.startswith("-"):
            try:
                _parse_bool(following)
            except argparse.ArgumentTypeError:
                out.append("true")
    return out


def _parse_memory(text: str) -> int | float:
    """Bytes (``4000000000``, ``4GiB``, ``512MiB``) or a fraction (``0.5``)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    if "." in lowered:
        return float(lowered)
    return int(lowered)


def _parse_options(text: str) -> dict[str, str]:
    """``key=value,key=value`` -> a dict (values stay text: the platform converts)."""
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        options[key.strip()] = value.strip()
    return options


def _parse_mm_limit(text: str) -> int:
    """``4``, ``image=4`` or vLLM's ``{"image": 4}`` -> the images one prompt may carry."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        limits = json.loads(text) if text.startswith("{") else _parse_options(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected N, image=N or {{\"image\": N}}: {exc}")
    unknown = sorted(set(limits) - {"image"})
    if unknown or not str(limits.get("image", "")).isdigit():
        raise argparse.ArgumentTypeError(
            f"expected N, image=N or {{\"image\": N}} (only images are taken), got {text!r}")
    return int(limits["image"])


_TYPES: dict[str, Any] = {"kv_cache_memory": _parse_memory, "gpu_memory_utilization": float,
                          "platform_options": _parse_options, "speculative_config": str,
                          "quantization_config": str,
                          "limit_mm_per_prompt": _parse_mm_limit}


def add_engine_options(parser: argparse.ArgumentParser, many_models: bool = False) -> None:
    """Add ``--model`` and one flag per ``EngineConfig`` field.

    :param many_models: ``--model`` may be repeated (``quire serve``): its value is then
        a list, None when not given (``quire.entrypoints.cli.model_list`` reads it)."""
    for f in dataclasses.fields(EngineConfig):
        help_text = f.metadata.get("help", "")
        if f.name == "model" and many_models:
            parser.add_argument("--model", action="append", default=None,
                                help=f"{help_text}, or a built-in name (default: "
                                     f"{DEFAULT_MODEL}); repeat it to serve several models "
                                     "under one KV memory budget")
            continue
        if f.name == "model":
            parser.add_argument("--model", default=DEFAULT_MODEL,
                                help=f"{help_text}, or a built-in name (default: {DEFAULT_MODEL})")
            continue
        kind = _TYPES.get(f.name)
        bare: dict[str, Any] = {}
        if kind is None:
            if f.type in ("bool", bool):  # a bare flag means true (vLLM's --enforce-eager)
                kind, bare = _parse_bool, {"nargs": "?", "const": True}
            elif "int" in str(f.type):
                kind = int
            else:
                kind = str
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(_flag(f.name), type=kind, default=default, metavar=f.name.upper(),
                            help=_with_default(help_text, default), **bare)


def _with_default(help_text: str, default: Any) -> str:
    """``help_text`` stating the flag's default once: as the field's help words it where
    it does (a None default means something: "the model's", "the platform's"; each such
    field's help says what, which a test checks), else the value as the flag takes it
    (``true``, not ``True``)."""
    if "default: " in help_text or default is None:
        return help_text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{help_text} (default: {shown})"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """:raises UsageError: naming the flag whose value ``EngineConfig`` rejected."""
    model = args.model
    if model is None or isinstance(model, list):  # serve's repeatable --model
        if len(model or ()) > 1 or not all(isinstance(m, str) for m in model or ()):
            raise UsageError("--model: several models are served by 'quire serve' only")
        args.model = model[0] if model else DEFAULT_MODEL
    tag = getattr(args, "model_tag", None)  # ``quire serve MODEL``
    if tag is not None:
        if args.model not in (DEFAULT_MODEL, tag):
            raise UsageError(f"--model: {args.model!r} and the model argument {tag!r} "
                             "differ; give one")
        args.model = tag
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        raise engine_error(exc, anywhere=True) from exc


def engine_error(exc: Exception, *, anywhere: bool = False) -> UsageError:
    """``exc`` as a usage error that names the flag of the field it is about.

    The field is the first one the message names as a word (``pooling applies to
    embedding models`` is about ``--pooling``, not ``--model``). With ``anywhere`` false
    (an error of loading, whose words may name a field in passing) only a message that
    begins with the field counts: ``max_model_len=99999 exceeds the model's context``.
    """
    message = str(exc)
    found = [(m.start(), name) for name in (f.name for f in dataclasses.fields(EngineConfig))
             if (m := re.search(rf"\b{name}\b", message))]
    at, name = min(found, default=(len(message), ""))
    if name and (anywhere or at == 0):
        return UsageError(f"{_flag(name)}: {message}")
    return UsageError(message)
