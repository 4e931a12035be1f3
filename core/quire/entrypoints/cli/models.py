"""``quire models``: built-in model names and the model files already cached."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "models", help="list built-in model names and cached model files",
        description="List the built-in model names (usable as --model), whether each is "
                    "cached and what it serves (chat needs a chat template), then any "
                    "other model files in the cache.")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quire.model_store import (
        BUILTIN_MODELS,
        DEFAULT_MODEL,
        cache_dir,
        cached_models,
    )

    cached = {p.name: p for p in cached_models()}
    print(f"cache: {cache_dir() / 'models'}")
    for name, model in sorted(BUILTIN_MODELS.items()):
        path = cached.pop(model.filename, None)
        status = f"cached at {path}" if path else "not cached (fetched on first use)"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {status}; serves {model.serves}")
    for filename, path in sorted(cached.items()):
        print(f"{filename}: cached at {path} (use --model {path})")
    return 0
