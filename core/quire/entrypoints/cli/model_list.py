"""The models ``quire serve`` serves: ``--model`` once or more, or ``model:`` in
``--config`` as a list of names or of mappings with each model's own options.

A mapping's keys are ``model`` (required), ``served_model_name``, the request-side flags
``chat_template``, ``tool_call_parser``, ``reasoning_parser``, ``lora_modules``, and any
engine flag; a key it does not give takes the command line's value. The KV memory
budget is the server's, one for every model (:mod:`quire.engine.kv_budget`), so the
flags that size it are refused per model, as is data parallelism.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from quire.config import EngineConfig
from quire.entrypoints.cli.common import UsageError
from quire.entrypoints.cli.engine_options import engine_error
from quire.model_store import DEFAULT_MODEL

#: Per-model keys that are serve's own flags rather than engine options.
REQUEST_SIDE = ("served_model_name", "chat_template", "tool_call_parser",
                "reasoning_parser", "lora_modules")
#: Engine options one server sets for all its models.
SERVER_WIDE = ("kv_cache_memory", "gpu_memory_utilization", "data_parallel_size")


@dataclass(frozen=True)
class ModelEntry:
    """One model to serve: the name clients use, its engine options, and its own
    request-side options (``REQUEST_SIDE`` but the name; the command line's by default).
    """

    name: str
    config: EngineConfig
    options: dict[str, Any] = field(default_factory=dict)


def model_items(args: argparse.Namespace) -> list[str | dict[str, Any]]:
    """``--model`` values (and ``quire serve MODEL``) as given: names, or mappings from
    ``--config``; the default model when none is."""
    items: list[str | dict[str, Any]] = []
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        items.append(tag)
    model = args.model
    given = model if isinstance(model, list) else [] if model is None else [model]
    if tag is not None and given == [tag]:  # ``quire serve X --model X``: one model
        given = []
    items += given
    return items or [DEFAULT_MODEL]


def served_names(args: argparse.Namespace) -> list[str]:
    value = args.served_model_name
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def single_model(args: argparse.Namespace) -> None:
    """Make ``args`` name one model (``args.model``, ``args.served_model_name`` as text),
    as every command but a several-model serve reads them.

    :raises UsageError: naming the flag that gives more than one.
    """
    items = model_items(args)
    if len(items) > 1:
        raise UsageError(f"--model: given {len(items)} times; only 'quire serve' serves "
                         "several models")
    if isinstance(items[0], dict):
        raise UsageError("--config: a model given as a mapping is for serving several "
                         "models; give its options as keys of the file")
    args.model, args.model_tag = items[0], None
    names = served_names(args)
    if len(names) > 1:
        raise UsageError(f"--served-model-name: {len(names)} names for one model (one name "
                         "per --model)")
    args.served_model_name = names[0] if names else None


def model_entries(args: argparse.Namespace) -> list[ModelEntry]:
    """Every model ``args`` names, with its options.

    :raises UsageError: a mapping without ``model`` or with an unknown or server-wide
        key, a bad engine option (naming the model and the key), a count of
        ``--served-model-name`` values that is not one per model, two models of one
        name.
    """
    items = model_items(args)
    names = served_names(args)
    if names and len(names) != len(items):
        raise UsageError(f"--served-model-name: {len(names)} names for {len(items)} "
                         "models (one per --model, in order)")
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    entries = []
    for i, item in enumerate(items):
        where = f"model {i + 1} ({item if isinstance(item, str) else item.get('model')})"
        given = {"model": item} if isinstance(item, str) else _keys(item, where)
        options = {key: given.pop(key, getattr(args, key)) for key in REQUEST_SIDE}
        name = options.pop("served_model_name")
        if isinstance(name, list) or name is None:
            name = names[i] if names else given["model"]
        try:
            config = EngineConfig(**{**base, **given})
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{where}: {engine_error(exc, anywhere=True)}") from exc
        entries.append(ModelEntry(str(name), config, options))
    served = [e.name for e in entries]
    for name in served:
        if served.count(name) > 1:
            raise UsageError(f"--model: two models are served as {name!r}; name them "
                             "apart with --served-model-name")
    return entries


def _check_parser(name: str, value: Any, where: str) -> None:
    """A model's ``tool_call_parser`` or ``reasoning_parser`` is one the flag offers.

    :raises UsageError: naming the model, the key and the choices."""
    if name not in ("tool_call_parser", "reasoning_parser") or value is None:
        return
    from quire.entrypoints.server.reasoning_parsers import PARSERS as REASONING
    from quire.entrypoints.server.tool_parsers import PARSERS as TOOLS

    choices = TOOLS if name == "tool_call_parser" else REASONING
    if value not in choices:
        raise UsageError(f"--config: {where}: {name} {value!r} is not one of "
                         f"{', '.join(sorted(choices))}")


def _keys(item: Any, where: str) -> dict[str, Any]:
    """A mapping item's keys, checked and spelled as fields (``max-num-seqs`` ->
    ``max_num_seqs``)."""
    if not isinstance(item, dict):
        raise UsageError(f"--config: {where}: expected a model name or a mapping, got "
                         f"{type(item).__name__}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {}
    for key, value in item.items():
        name = str(key).replace("-", "_")
        if name in SERVER_WIDE:
            raise UsageError(f"--config: {where}: {key} is the server's, one for every "
                             "model (set it at the top level or on the command line)")
        if name not in fields and name not in REQUEST_SIDE:
            known = ", ".join(sorted(k.replace("_", "-") for k in
                                     (fields | set(REQUEST_SIDE)) - set(SERVER_WIDE)))
            raise UsageError(f"--config: {where}: unknown key {key!r}; known keys: {known}")
        _check_parser(name, value, where)
        out[name] = value
    if "model" not in out:
        raise UsageError(f"--config: {where}: a model mapping needs a 'model' key")
    return out
