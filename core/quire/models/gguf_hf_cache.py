"""A GGUF file's Hugging Face config and tokenizer, converted once and cached.

transformers builds both by parsing the whole metadata block of the file (a 49k-entry
vocabulary takes seconds, and config and tokenizer each parse it again). The converted
files are saved once as an ordinary Hugging Face directory under the cache directory,
keyed by the GGUF file's path, size and modification time, so a later start reads two
small JSON files instead. Weights are never cached: they stay in the GGUF file.

Beside the Hugging Face ``config.json`` (for other tools) the entry holds every value of
the family's config class (:data:`FULL_CONFIG`), which :func:`cached_config` reads into
transformers' base config class. Importing a family's config class is a large share of
a start's time and memory (transformers 5 pulls torch's distributed tensor package and
sympy in with it), for values that are already known.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from quire.model_store import cache_dir
from quire.models.gguf_bpe_tables import load_backend, save_tables
from quire.models.gguf_file import load_gguf_config

logger = logging.getLogger(__name__)

#: Bumped whenever what is saved changes, so old entries are not reused.
_FORMAT = "6"


def hf_dir_for_gguf(path: str, root: Path | None = None) -> Path:
    """A directory holding ``config.json`` and the tokenizer files of GGUF ``path``.

    Converts and saves them on first use; writes are atomic (a temporary directory is
    renamed into place), so concurrent starts never see half an entry. When the cache
    cannot be written, the files go to a temporary directory instead.
    """
    source = Path(path).resolve()
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_FORMAT}\0{transformers.__version__}"
        .encode()
    ).hexdigest()[:16]
    root = root or cache_dir() / "gguf-hf"
    target = root / f"{source.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    except OSError as exc:
        logger.warning("cannot write the GGUF cache under %s (%s); converting in a "
                       "temporary directory", root, exc)
        staging = Path(tempfile.mkdtemp(prefix="quire-gguf-"))
        _convert(source, staging)
        return staging
    _convert(source, staging)
    try:
        os.replace(staging, target)
    except OSError:  # another process got there first: use its entry
        shutil.rmtree(staging, ignore_errors=True)
    return target


#: Every value of the family's config class, and its attribute aliases (``attribute_map``:
#: MoE families read ``num_experts`` as ``num_local_experts``).
FULL_CONFIG = "quire_config.json"


def cached_config(directory: Path) -> PretrainedConfig:
    """The config saved in ``directory`` by :func:`hf_dir_for_gguf`, as transformers' base
    config class holding the family class's values and aliases.

    Every value the family class held at conversion is an attribute here, its derived
    ones (``head_dim``, Gemma 3's ``layer_types``) included; what stays behind are the
    class's own constants that Quire does not read (transformers' tensor-parallel plans).
    """
    with open(directory / FULL_CONFIG, encoding="utf-8") as f:
        saved = json.load(f)
    config = PretrainedConfig.from_dict(saved["values"])
    config.attribute_map = dict(saved["attribute_map"])  # per instance: still picklable
    return config


def cached_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``directory`` by :func:`hf_dir_for_gguf`, loaded by the class
    it was saved from (``tokenizer_config.json``'s ``tokenizer_class``), as ``AutoTokenizer``
    resolved it at conversion, without importing ``AutoTokenizer``'s tables of every
    family. A class transformers no longer exports falls back to ``AutoTokenizer``.

    A class that only builds its pipeline (:func:`_builds_pipeline_only`) is loaded as the
    generic fast tokenizer over the saved ``tokenizer.json``, which that class wrote in
    this transformers version (it is in the cache key): the same tokenizer, without the
    Python copy of the vocabulary and merges such a class keeps (for a large vocabulary,
    more than the tokenizer itself: docs/bench.md, issue 29's memory rows). The
    conversion records that decision (:data:`LOADING`), so that a start does not import
    the family's class only to make it again (transformers' lazy import of a family
    scans every family's module).
    """
    plan = _saved_plan(directory) or loading_plan(directory)
    generic = _generic_fast_class()
    if plan["generic"] and generic is not None:
        return _generic_from_pretrained(generic, directory, plan["defaults"])
    saved = getattr(transformers, plan["class"], None) if plan["class"] else None
    if isinstance(saved, type) and issubclass(saved, PreTrainedTokenizerBase):
        return saved.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, config=cached_config(directory))


#: How a start loads the converted tokenizer (:func:`loading_plan`), written at conversion.
LOADING = "quire_tokenizer.json"


def loading_plan(directory: Path) -> dict[str, Any]:
    """How :func:`cached_tokenizer` loads ``directory``'s tokenizer: ``class``, the saved
    class's name where transformers exports it (else None: ``AutoTokenizer``);
    ``generic``, whether it loads as the generic fast tokenizer instead; ``defaults``,
    the saved class's settings the generic load then takes, where the saved settings do
    not name their own."""
    try:
        with open(directory / "tokenizer_config.json", encoding="utf-8") as f:
            settings = json.load(f)
    except (OSError, ValueError):
        settings = {}
    if not isinstance(settings, dict):
        settings = {}
    name = settings.get("tokenizer_class")
    saved = getattr(transformers, name, None) if isinstance(name, str) else None
    plan: dict[str, Any] = {"class": None, "generic": False, "defaults": {}}
    if isinstance(saved, type) and issubclass(saved, PreTrainedTokenizerBase):
        plan["class"] = name
        generic = _generic_fast_class()
        if (generic is not None and (directory / "tokenizer.json").is_file()
                and _builds_pipeline_only(saved, generic)):
            plan["generic"] = True
            plan["defaults"] = {key: getattr(saved, key) for key in _CLASS_DEFAULTS
                                if key not in settings}
    return plan


def _saved_plan(directory: Path) -> dict[str, Any] | None:
    """The plan the conversion wrote, or None where there is none (a directory that
    transformers saved, an entry being written) or it is not one."""
    try:
        plan = json.loads((directory / LOADING).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(plan, dict) and isinstance(plan.get("class"), (str, type(None)))
            and isinstance(plan.get("generic"), bool)
            and isinstance(plan.get("defaults"), dict)):
        return None
    return plan


def _generic_from_pretrained(generic: type, directory: Path,
                             defaults: dict[str, Any]) -> PreTrainedTokenizerBase:
    """``generic.from_pretrained(directory)``, its pipeline rebuilt from the BPE tables
    where the conversion saved them (:mod:`quire.models.gguf_bpe_tables`) instead of
    parsed from ``tokenizer.json``: the same settings, special tokens and templates,
    read the same way. A class whose ``__init__`` takes a ready pipeline (as
    transformers' own model classes build theirs) carries it there, and the result is
    then of the generic class."""
    pipeline = load_backend(directory)
    if pipeline is None:
        return generic.from_pretrained(directory, **defaults)
    tokenizer = _with_pipeline(generic).from_pretrained(directory, _pipeline=pipeline,
                                                        **defaults)
    tokenizer.__class__ = generic  # what it is: the subclass only carried the pipeline
    return tokenizer


@functools.cache
def _with_pipeline(generic: type) -> type:
    """A subclass of ``generic`` whose load takes its pipeline from a ``_pipeline``
    argument: ``tokenizer.json``'s path is dropped where transformers would open it."""

    class WithPipeline(generic):  # type: ignore[misc, valid-type]
        @classmethod
        def convert_to_native_format(cls, trust_remote_code: bool = False,
                                     **kwargs: Any) -> dict[str, Any]:
            kwargs.pop("tokenizer_file", None)
            return kwargs

        def __init__(self, *args: Any, _pipeline: Any, **kwargs: Any) -> None:
            self._tokenizer = _pipeline
            super().__init__(*args, **kwargs)

    return WithPipeline


#: What a tokenizer class may define and still only build its pipeline: its ``__init__``
#: (which builds the ``tokenizers`` pipeline, then saved as ``tokenizer.json``), that
#: pipeline's model class, and class attributes passed on to the generic class's load.
_PIPELINE_ONLY_MEMBERS = frozenset({
    "__module__", "__doc__", "__qualname__", "__annotations__", "__init__", "model",
    "vocab_files_names", "padding_side", "model_input_names", "slow_tokenizer_class",
})


#: Class attributes a tokenizer class may set that the generic class takes as settings.
_CLASS_DEFAULTS = ("padding_side", "model_input_names")


def _generic_fast_class() -> type | None:
    """transformers' generic fast tokenizer (``TokenizersBackend``, ``PreTrainedTokenizerFast``
    before transformers 5), or None."""
    generic = getattr(transformers, "TokenizersBackend", None)
    return generic if isinstance(generic, type) else None


def _builds_pipeline_only(cls: type, generic: type) -> bool:
    """``cls`` (a subclass of ``generic``, or ``generic`` itself) adds no method or
    property of its own to ``generic``: only what :data:`_PIPELINE_ONLY_MEMBERS` allows,
    in every class between the two."""
    if not issubclass(cls, generic):
        return False
    for klass in cls.__mro__:
        if klass is generic:
            return True
        if not set(vars(klass)) <= _PIPELINE_ONLY_MEMBERS:
            return False
    return False


#: Written instead of tokenizer files when the GGUF file's vocabulary cannot be converted.
NO_TOKENIZER = "no_tokenizer.txt"


def _convert(source: Path, out: Path) -> None:
    with _metadata_parsed_once():
        config = load_gguf_config(str(source))
        config.save_pretrained(out)
        full = {"values": config.to_dict(),
                "attribute_map": dict(type(config).attribute_map)}
        (out / FULL_CONFIG).write_text(json.dumps(full, indent=1, sort_keys=True) + "\n",
                                       encoding="utf-8")
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        except (ValueError, OSError, KeyError) as exc:
            # The weights are still usable with a tokenizer from elsewhere (tokenizer=...).
            (out / NO_TOKENIZER).write_text(f"{type(exc).__name__}: {exc}\n")
            return
    tokenizer.save_pretrained(out)
    record_added_tokens(out)
    save_tables(out)
    (out / LOADING).write_text(json.dumps(loading_plan(out), indent=1) + "\n",
                               encoding="utf-8")


#: Held while a conversion's memo is in transformers' module (one conversion at a time
#: puts it there and takes it away).
_CONVERTING = threading.Lock()


@contextlib.contextmanager
def _metadata_parsed_once() -> Iterator[None]:
    """Within a conversion, transformers' whole-metadata parse of a GGUF file
    (``load_gguf_checkpoint`` without tensors: ``gguf.GGUFReader``, a numpy view for
    every part of every field, the vocabulary included) runs once per file. Both the
    config and the tokenizer's config call it for these families, and it is most of a
    conversion's time; the later call gets a copy of the first's result. The function
    is looked up in its module at each call, which is where this puts the memo, and
    takes it away again at the end."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parsed: dict[str, Any] = {}
    with _CONVERTING:
        parse = gguf_utils.load_gguf_checkpoint

        def once(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
            if return_tensors or args or kwargs:
                return parse(path, return_tensors, *args, **kwargs)
            key = os.fspath(path)
            if key not in parsed:
                parsed[key] = parse(path, return_tensors=False)
            return copy.deepcopy(parsed[key])

        gguf_utils.load_gguf_checkpoint = once
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = parse


def record_added_tokens(directory: Path) -> None:
    """Copy ``tokenizer.json``'s added tokens into ``tokenizer_config.json`` as
    ``added_tokens_decoder``, where a saved tokenizer has none (transformers 5 saves
    none). Without it, every load parses the whole ``tokenizer.json`` in Python only to
    read them, before the Rust parse of the same file: for a large vocabulary the longest
    part of a start (docs/bench.md, "Start-up"); with it, the load builds the same
    ``AddedToken`` objects from these entries."""
    settings_path = directory / "tokenizer_config.json"
    pipeline_path = directory / "tokenizer.json"
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8"))
        pipeline = json.loads(pipeline_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no such files: another kind of tokenizer
        return
    if not isinstance(settings, dict) or "added_tokens_decoder" in settings:
        return
    added = {}
    for token in pipeline.get("added_tokens", ()):
        token = dict(token)
        added[str(token.pop("id"))] = token
    settings["added_tokens_decoder"] = added
    settings_path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n",
                             encoding="utf-8")
