"""A converted GGUF file's BPE tokenizer saved a second way, rebuilt at start without
parsing ``tokenizer.json``.

``tokenizers`` reads a BPE model's JSON through an untagged enum: serde buffers the whole
vocabulary and merge list as a tree of values before building the model from it. For a
large vocabulary that is most of a start, and the tree's freed strings leave tens of
thousands of holes in the C heap among the tokenizer's own allocations; a step's
temporaries land there later and make those pages resident again (docs/quantization.md,
"Loading"). Built from Python objects instead (the ``BPE(vocab, merges)`` constructor),
the same model takes about half the time and leaves no holes.

At conversion :func:`save_tables` writes the pipeline without its vocabulary, merges and
added tokens, and those three as a ``marshal`` file, only after checking that the
rebuilt tokenizer serializes exactly as ``tokenizer.json`` does. ``tokenizer.json``
stays, for other tools and for :func:`load_backend`'s refusals: another model type,
tables written by another ``tokenizers`` version.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import marshal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import BPE

logger = logging.getLogger(__name__)

#: The tables file in a converted directory.
TABLES = "quire_bpe_tables.marshal"

#: What the tables hold, so that a file of another layout is never read as this one.
_LAYOUT = 1

#: An added token's fields, as ``tokenizer.json`` and ``AddedToken`` name them.
_ADDED_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def save_tables(directory: Path) -> bool:
    """Write :data:`TABLES` beside ``directory``'s ``tokenizer.json`` where its model is BPE
    and the tokenizer rebuilt from the tables serializes exactly as the file's does;
    False (nothing written) otherwise."""
    try:
        saved = (directory / "tokenizer.json").read_text(encoding="utf-8")
        pipeline = json.loads(saved)
        model = pipeline["model"]
        if not isinstance(model, dict) or model.get("type") != "BPE":
            return False
        tables = _split(pipeline)
        rebuilt = _rebuild(tables)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        # whatever fails here, the JSON path stays
        logger.debug("no BPE tables for %s: %s", directory, exc)
        return False
    if rebuilt is None or _canonical(rebuilt.to_str()) != _canonical(
            Tokenizer.from_str(saved).to_str()):
        logger.debug("no BPE tables for %s: the rebuilt tokenizer differs", directory)
        return False
    (directory / TABLES).write_bytes(marshal.dumps(tables))
    return True


def load_backend(directory: Path) -> Tokenizer | None:
    """The tokenizer :func:`save_tables` saved in ``directory``, rebuilt from its tables;
    None where there are none, or where they were written by another ``tokenizers``
    version or layout (the caller then parses ``tokenizer.json``)."""
    with _no_collection():
        try:
            tables = marshal.loads((directory / TABLES).read_bytes())
        except (OSError, ValueError, EOFError, TypeError):
            return None
        if not (isinstance(tables, dict) and tables.get("layout") == _LAYOUT
                and tables.get("tokenizers") == tokenizers.__version__):
            return None
        try:
            return _rebuild(tables)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            logger.warning("the BPE tables in %s do not load (%s); reading "
                           "tokenizer.json instead", directory, exc)
            return None


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused: the tables are hundreds of thousands of
    tuples, whose allocation would otherwise run full collections over every object the
    process holds (in a process that imported transformers, longer than the load).
    They hold no cycles; reference counting frees them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _split(pipeline: dict[str, Any]) -> dict[str, Any]:
    """The pipeline without its vocabulary, merges and added tokens (as JSON), and those
    three as plain values."""
    model = pipeline["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
              for m in model["merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a merge that is not a pair")
    shell = dict(pipeline, added_tokens=[], model=dict(model, vocab={}, merges=[]))
    # BPE() takes an absent option as its default, but refuses None for some
    options = {k: v for k, v in model.items()
               if k not in ("type", "vocab", "merges") and v is not None}
    return {"layout": _LAYOUT, "tokenizers": tokenizers.__version__,
            "shell": json.dumps(shell, ensure_ascii=False), "options": options,
            "vocab": dict(model["vocab"]), "merges": merges,
            "added": [dict(token) for token in pipeline["added_tokens"]]}


def _rebuild(tables: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer from its tables: the shell parsed, the BPE model built from Python
    objects, the added tokens added in order. None where an added token did not get its
    saved id."""
    tokenizer = Tokenizer.from_str(tables["shell"])
    tokenizer.model = BPE(vocab=tables["vocab"], merges=tables["merges"], **tables["options"])
    added = tables["added"]
    if added:
        tokenizer.add_tokens([
            AddedToken(token["content"], **{k: token[k] for k in _ADDED_FIELDS if k in token})
            for token in added])
    for token in added:
        if tokenizer.token_to_id(token["content"]) != token["id"]:
            return None
    return tokenizer


def _canonical(serialized: str) -> str:
    return json.dumps(json.loads(serialized), sort_keys=True, ensure_ascii=False)
