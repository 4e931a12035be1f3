"""Models named by Hugging Face Hub repo id (``org/name``), fetched into the Hub's cache.

``huggingface_hub`` does the fetching, so its standard cache (``HF_HOME``/``HF_HUB_CACHE``),
``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE`` and its progress bars (on stderr) all
apply as for any Hub client. Only what the engine reads is downloaded: config, tokenizer,
generation config, chat template, safetensors weights (``*.bin`` only when a repo has
none) and sentence-transformers' module files; a GGUF file only when one is named
(``org/name:file.gguf``), and then nothing else, as a GGUF carries its own tokenizer.

The front downloads once (:func:`download`) and passes the commit it got on as the
revision; every other process (engine cores, workers) then finds that commit in the cache
with no request to the Hub (:func:`snapshot_path`), and fetches it only where the cache
lacks it: a Ray node elsewhere, with its own disk.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quire.config import EngineConfig

logger = logging.getLogger(__name__)

_COMMIT = re.compile(r"[0-9a-f]{40}")

#: Files read by the config, tokenizer, generation and chat-template loaders.
_METADATA = frozenset((
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
    "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja",
    # sentence-transformers: which modules follow the model (pooling, normalisation)
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
))
_METADATA_SUFFIXES = (".tiktoken",)
#: sentence-transformers' module folders (``1_Pooling``, ``2_Dense``, ...).
_MODULE_DIR = re.compile(r"\d+_[A-Za-z]+")


class ModelNotCachedError(FileNotFoundError, ValueError):
    """A Hub model that must come from the cache (offline) and is not there."""


@dataclass(frozen=True)
class HubModel:
    """A model repository on the Hub, and the GGUF file in it when one is chosen."""

    repo_id: str
    gguf_file: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.gguf_file}" if self.gguf_file else "")


def parse_hub_name(name: str, gguf_file: str | None = None) -> HubModel | None:
    """``org/name`` or ``org/name:file.gguf`` as a :class:`HubModel`; None when ``name``
    is not a plausible repo id (huggingface_hub's own validation, with a namespace).

    :raises ValueError: when the name and ``gguf_file`` pick two different files.
    """
    repo_id, sep, in_name = name.partition(":")
    if repo_id.count("/") != 1 or not _valid_repo_id(repo_id):
        return None
    if sep and not in_name:
        raise ValueError(f"model {name!r}: name the GGUF file after ':' (org/name:file.gguf)")
    if in_name and gguf_file and in_name != gguf_file:
        raise ValueError(f"model {name!r} names GGUF file {in_name!r} but gguf_file is "
                         f"{gguf_file!r}; give one")
    chosen = in_name or gguf_file
    if chosen is not None and not chosen.endswith(".gguf"):
        raise ValueError(f"model {name!r}: {chosen!r} is not a .gguf file")
    return HubModel(repo_id, chosen)


def _valid_repo_id(repo_id: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def select_files(files: Iterable[str]) -> list[str]:
    """The files of a repository the engine needs (no GGUF chosen), sorted.

    Top-level metadata and safetensors weights with their index; ``*.bin`` weights only
    when there is no safetensors file; sentence-transformers module folders alike. Never
    ``original/``, ``consolidated*``, ``*.pth`` or ``*.gguf``: other formats of the same
    weights.
    """
    by_dir: dict[str, list[str]] = {}
    for name in files:
        parent = str(PurePosixPath(name).parent)
        if parent == "." or _MODULE_DIR.fullmatch(parent):
            by_dir.setdefault(parent, []).append(name)
    chosen: list[str] = []
    for names in by_dir.values():
        has_safetensors = any(n.endswith(".safetensors") for n in names)
        weights = (".safetensors", ".safetensors.index.json") if has_safetensors \
            else (".bin", ".bin.index.json")
        for name in names:
            base = PurePosixPath(name).name
            if base.startswith("consolidated"):
                continue
            if base in _METADATA or base.endswith(_METADATA_SUFFIXES + weights) \
                    or (base.endswith(".json") and _MODULE_DIR.fullmatch(
                        str(PurePosixPath(name).parent))):
                chosen.append(name)
    return sorted(chosen)


def fetch_model(config: EngineConfig) -> EngineConfig:
    """``config`` once its Hub model is in the cache, its revision the commit fetched.

    Called once by the front, before any other process starts: those resolve the pinned
    commit from the cache without asking the Hub, and all see the same files even if the
    branch moves meanwhile. A local path or a built-in name leaves ``config`` as it is.

    :raises ValueError: as :func:`snapshot_path`.
    """
    from quire.model_store import BUILTIN_MODELS

    if os.path.exists(config.model) or config.model in BUILTIN_MODELS:
        return config
    model = parse_hub_name(config.model, config.gguf_file)
    if model is None:
        return config  # resolve_model names what a model may be
    path = snapshot_path(model, config.revision)
    return dataclasses.replace(config, revision=commit_of(path, model))


def snapshot_path(model: HubModel, revision: str | None) -> str:
    """The local path of ``model`` (its snapshot folder, or its GGUF file): from the cache
    when offline or when ``revision`` is a commit already cached, downloaded otherwise.

    :raises ValueError: naming the repository: not found, gated, no such revision or file.
    :raises ModelNotCachedError: offline, and the cache does not hold it.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or (revision is not None and _COMMIT.fullmatch(revision)):
        cached = cached_path(model, revision)
        if cached is not None:
            return cached
        if constants.HF_HUB_OFFLINE:
            raise ModelNotCachedError(
                f"model {str(model)!r} (revision {revision or 'main'}) is not in the Hugging "
                f"Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set: unset it to "
                f"download the model, or fill the cache once online "
                f"(`hf download {model.repo_id}`)")
    return download(model, revision)[0]


def cached_path(model: HubModel, revision: str | None) -> str | None:
    """``model``'s path in the cache at ``revision`` (a commit, or a branch or tag the
    cache has seen), without asking the Hub; None when the cache lacks it."""
    from huggingface_hub import try_to_load_from_cache

    probe = model.gguf_file or "config.json"
    found = try_to_load_from_cache(model.repo_id, probe, revision=revision)
    if not isinstance(found, str):  # None, or the marker of a file known not to exist
        return None
    if model.gguf_file:
        return found
    folder = os.path.dirname(found)
    if not any(glob.glob(os.path.join(folder, pattern))
               for pattern in ("*.safetensors", "*.bin")):
        return None  # only part of the repository was fetched, by some other tool
    return folder


def download(model: HubModel, revision: str | None) -> tuple[str, str]:
    """Fetch what the engine needs of ``model`` at ``revision`` (default: the main
    branch) into the cache; returns its local path and the commit it came from.

    :raises ValueError: naming the repository: not found, gated, no such revision or
        file, or the Hub unreachable with nothing cached.
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    try:
        info = HfApi().model_info(model.repo_id, revision=revision)
        files = [s.rfilename for s in info.siblings or ()]
        wanted = _wanted(model, files, info.sha or "")
        folder = snapshot_download(model.repo_id, revision=revision,
                                   allow_patterns=[glob.escape(f) for f in wanted])
    except _hub_errors() as exc:
        cached = cached_path(model, revision) if _is_transport_error(exc) else None
        if cached is None:
            raise ValueError(_explain(exc, model, revision, constants.ENDPOINT)) from exc
        logger.warning("the Hub is unreachable (%s); using %s from the cache", exc, model)
        return cached, commit_of(cached, model)
    path = os.path.join(folder, *model.gguf_file.split("/")) if model.gguf_file else folder
    return path, commit_of(path, model)


def commit_of(path: str, model: HubModel) -> str:
    """The commit of a path :func:`snapshot_path` returned (its snapshot folder's name)."""
    folder = os.path.normpath(path)
    for _ in (model.gguf_file.split("/") if model.gguf_file else ()):
        folder = os.path.dirname(folder)
    return os.path.basename(folder)


def _wanted(model: HubModel, files: list[str], commit: str) -> list[str]:
    """The files to fetch; raises ValueError when the repository cannot serve ``model``."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if model.gguf_file:
        if model.gguf_file not in files:
            raise ValueError(
                f"model {model.repo_id!r} (commit {commit}) has no file {model.gguf_file!r}; "
                f"its GGUF files: {', '.join(ggufs) or 'none'}")
        return [model.gguf_file]
    if "config.json" not in files:
        if ggufs:
            raise ValueError(
                f"model {model.repo_id!r} holds GGUF files only; pick one with "
                f"{model.repo_id}:FILE.gguf or --gguf-file FILE.gguf: {', '.join(ggufs)}")
        raise ValueError(f"model {model.repo_id!r} (commit {commit}) has no config.json: "
                         "not a transformers checkpoint")
    wanted = select_files(files)
    if not any(f.endswith((".safetensors", ".bin")) for f in wanted):
        raise ValueError(f"model {model.repo_id!r} (commit {commit}) has no safetensors "
                         f"or .bin weights at its top level")
    return wanted


def _hub_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    return (HfHubHTTPError, LocalEntryNotFoundError, ConnectionError, TimeoutError,
            *_transport_errors())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection and timeout errors (huggingface_hub 2.x uses httpx2,
    1.x httpx)."""
    for module in ("httpx2", "httpx"):
        try:
            client = __import__(module)
        except ImportError:
            continue
        return (client.TransportError,)
    return ()


def _is_transport_error(exc: BaseException) -> bool:
    """No answer from the Hub (as opposed to an answer that refuses)."""
    from huggingface_hub.errors import HfHubHTTPError

    return not isinstance(exc, HfHubHTTPError)


def _explain(exc: BaseException, model: HubModel, revision: str | None, endpoint: str) -> str:
    """One line naming the repository and what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = model.repo_id
    if isinstance(exc, GatedRepoError):
        return (f"model {repo!r} is gated: accept its terms at {endpoint}/{repo} and set "
                f"HF_TOKEN to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"model {repo!r} is neither a local path nor a model repository on "
                f"{endpoint} (if it is private, set HF_TOKEN to a token that can read it)")
    if isinstance(exc, RevisionNotFoundError):
        return (f"model {repo!r} has no revision {revision!r} (a branch, tag or commit) "
                f"on {endpoint}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"model {repo!r}: a file vanished from {endpoint} during the download; retry"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return f"model {repo!r}: {endpoint} answered {status} ({_first_line(exc)})"
    return (f"model {repo!r}: cannot reach {endpoint} ({_first_line(exc)}) and the Hugging "
            f"Face cache does not hold it; check the network, HF_ENDPOINT and any proxy")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
