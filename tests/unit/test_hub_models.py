"""Models named by Hugging Face Hub repo id, fetched from a local stand-in for the Hub.

A threaded HTTP server on 127.0.0.1 answers the routes huggingface_hub's
``snapshot_download`` uses (model info by revision, the file tree, ``HEAD``/``GET`` of
``resolve``), pointed at by ``HF_ENDPOINT`` with ``HF_HOME`` in a temporary directory, so
every check runs without the internet and leaves the user's cache alone.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.hub import ModelNotCachedError, fetch_model, parse_hub_name, select_files
from quire.model_store import resolve_model

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: Files a repo may hold that the engine must not download.
NOT_NEEDED = ("pytorch_model.bin", "model.Q4_0.gguf", "original/consolidated.00.pth",
              "consolidated.safetensors", "README.md", "onnx/model.onnx")


@dataclass
class FakeRepo:
    """Commits of one repository (path -> bytes each), its branches and tags, and whether
    it is gated."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False

    def add(self, files: dict[str, bytes], *refs: str) -> str:
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest())
                                             for k, v in files.items())).encode()).hexdigest()
        self.commits[sha] = files
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class FakeHub(ThreadingHTTPServer):
    """The Hub's model routes over :class:`FakeRepo`s; records every file ``GET``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos: dict[str, FakeRepo] = {}
        self.downloads: list[tuple[str, str]] = []  # (repo, path) of each file GET
        self.paths: list[str] = []  # "METHOD /path" of each request

    def asked_about(self, repo_id: str) -> list[str]:
        """The requests about ``repo_id`` (huggingface_hub may also ask other things once
        per process)."""
        return [p for p in self.paths if f"/{repo_id}/" in p + "/"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.server.paths.append(f"{self.command} {self.path}")
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
            # /api/models/{repo}[/revision/{rev}] (model info), /api/models/{repo}/tree/{rev}
            repo_id = "/".join(parts[2:4])
            kind, revision = (parts[4], parts[5]) if len(parts) == 6 else ("revision", "main")
            repo, sha = self._find(repo_id, revision)
            if repo is None or sha is None:
                return
            files = repo.commits[sha]
            if kind == "revision":
                payload: object = {"id": repo_id, "sha": sha,
                                   "siblings": [{"rfilename": f} for f in sorted(files)]}
            elif kind == "tree":
                payload = [{"type": "file", "path": f, "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest()}
                           for f, data in sorted(files.items())]
            else:
                return self._error(404, "EntryNotFound")
            return self._send(json.dumps(payload).encode(), body, "application/json")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, sha = self._find("/".join(parts[:2]), parts[3])
            if repo is None or sha is None:
                return
            path = "/".join(parts[4:])
            data = repo.commits[sha].get(path)
            if data is None:
                return self._error(404, "EntryNotFound", sha)
            if body:
                self.server.downloads.append(("/".join(parts[:2]), path))
            return self._send(data, body, "application/octet-stream", sha,
                              etag=hashlib.sha256(data).hexdigest())
        self._error(404, "RepoNotFound")

    def _find(self, repo_id: str, revision: str) -> tuple[FakeRepo | None, str | None]:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound")  # the Hub's answer for missing and private
            return None, None
        if repo.gated:
            self._error(401, "GatedRepo")
            return None, None
        sha = repo.commit(revision)
        if sha is None:
            self._error(404, "RevisionNotFound")
        return repo, sha

    def _send(self, data: bytes, body: bool, kind: str, commit: str | None = None,
              etag: str | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        if commit:
            self.send_header("X-Repo-Commit", commit)
        if etag:
            self.send_header("ETag", f'"{etag}"')
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, commit: str | None = None) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running fake Hub; huggingface_hub (whose constants are read at import) and its
    environment point at it, the cache in ``tmp_path``."""
    from huggingface_hub import constants

    server = FakeHub()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    cache = tmp_path / "hf" / "hub"
    for name, value in (("HF_ENDPOINT", server.url), ("HF_HOME", str(tmp_path / "hf")),
                        ("HF_HUB_CACHE", str(cache)),
                        ("QUIRE_CACHE_DIR", str(tmp_path / "quire"))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _tiny_repo(checkpoint: Path) -> FakeRepo:
    """The tiny checkpoint as ``main``, with files the engine must skip, and a ``v2``
    tag whose generation config differs."""
    files = _files_of(checkpoint)
    junk = {name: b"not for the engine " + name.encode() for name in NOT_NEEDED}
    repo = FakeRepo()
    repo.add({**files, **junk}, "main")
    repo.add({**files, "generation_config.json": b'{"max_new_tokens": 7}'}, "v2")
    return repo


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]


def test_repo_id_generates_as_the_local_directory_and_fills_the_standard_cache(
        hub: FakeHub, tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama")
    hub.repos["org/tiny"] = repo = _tiny_repo(checkpoint)
    with LLM(model=str(checkpoint), seed=0) as local:
        expected = _greedy(local)
    with LLM(model="org/tiny", seed=0) as fetched:
        assert _greedy(fetched) == expected
        assert fetched.engine.config.engine.model == "org/tiny"  # the name served
    main = repo.refs["main"]
    storage = tmp_path / "hf" / "hub" / "models--org--tiny"
    assert (storage / "refs" / "main").read_text() == main
    snapshot = storage / "snapshots" / main
    assert sorted(_files_of(snapshot)) == sorted(_files_of(checkpoint))
    assert (storage / "blobs").is_dir()
    downloaded = sorted(path for name, path in hub.downloads if name == "org/tiny")
    assert downloaded == sorted(_files_of(checkpoint))  # each file once, nothing else
    assert not set(downloaded) & set(NOT_NEEDED)


def test_front_fetches_once_and_pins_the_commit(hub: FakeHub, tiny_checkpoint) -> None:
    """The config the front hands the cores names the commit; resolving it again asks
    the Hub nothing (a worker process does exactly this)."""
    hub.repos["org/tiny"] = repo = _tiny_repo(tiny_checkpoint("llama"))
    pinned = fetch_model(EngineConfig(model="org/tiny"))
    assert pinned.model == "org/tiny" and pinned.revision == repo.refs["main"]
    asked = len(hub.paths)
    path = resolve_model(pinned.model, revision=pinned.revision)
    assert Path(path).name == repo.refs["main"] and len(hub.paths) == asked
    assert fetch_model(EngineConfig(model=path)).revision is None  # a path stays as is


@pytest.mark.slow
def test_worker_processes_ask_the_hub_nothing(hub: FakeHub, tiny_checkpoint, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tensor-parallel worker processes (their own huggingface_hub, this environment)
    make no request beyond the front's own fetch."""
    from huggingface_hub import constants

    checkpoint = tiny_checkpoint("llama")
    hub.repos["org/tiny"] = _tiny_repo(checkpoint)
    fetch_model(EngineConfig(model="org/tiny"))
    front_alone = len(hub.asked_about("org/tiny"))
    fresh = tmp_path / "fresh-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(fresh))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(fresh))
    with LLM(model="org/tiny", seed=0, tensor_parallel_size=2) as llm:
        tokens = _greedy(llm)
    assert len(hub.asked_about("org/tiny")) == 2 * front_alone
    with LLM(model=str(checkpoint), seed=0, tensor_parallel_size=2) as local:
        assert _greedy(local) == tokens


def test_revision_selects_another_commit(hub: FakeHub, tiny_checkpoint) -> None:
    hub.repos["org/tiny"] = repo = _tiny_repo(tiny_checkpoint("llama"))
    path = Path(resolve_model("org/tiny", revision="v2"))
    assert path.name == repo.refs["v2"] != repo.refs["main"]
    assert json.loads((path / "generation_config.json").read_text()) == {"max_new_tokens": 7}


@pytest.mark.parametrize("name,revision,words", [
    ("org/missing", None, ["'org/missing'", "HF_TOKEN"]),
    ("org/gated", None, ["'org/gated'", "gated", "HF_TOKEN"]),
    ("org/tiny", "no-such-branch", ["'org/tiny'", "'no-such-branch'"]),
])
def test_hub_refusals_are_one_clear_line(hub: FakeHub, tiny_checkpoint, name: str,
                                         revision: str | None, words: list[str]) -> None:
    hub.repos["org/tiny"] = _tiny_repo(tiny_checkpoint("llama"))
    hub.repos["org/gated"] = FakeRepo(gated=True)
    with pytest.raises(ValueError) as info:
        LLM(model=name, revision=revision)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_offline_uses_the_cache_and_names_what_is_missing(
        hub: FakeHub, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = tiny_checkpoint("llama")
    hub.repos["org/tiny"] = _tiny_repo(checkpoint)
    resolve_model("org/tiny")  # fills the cache, as an earlier online run would
    _offline(monkeypatch)
    hub.repos.clear()  # and the Hub could not answer anyway
    asked = len(hub.paths)
    with LLM(model=str(checkpoint), seed=0) as local:
        expected = _greedy(local)
    with LLM(model="org/tiny", seed=0) as cached:
        assert _greedy(cached) == expected
    assert len(hub.paths) == asked
    with pytest.raises(FileNotFoundError) as info:
        LLM(model="org/never-fetched")
    assert isinstance(info.value, ModelNotCachedError)
    assert "'org/never-fetched'" in str(info.value) and "HF_HUB_OFFLINE" in str(info.value)


def test_gguf_in_a_repo_is_fetched_alone(hub: FakeHub) -> None:
    hub.repos["org/ggufs"] = repo = FakeRepo()
    repo.add({"a.Q4_0.gguf": b"GGUF a", "b.Q8_0.gguf": b"GGUF b", "README.md": b"hi"}, "main")
    path = resolve_model("org/ggufs:b.Q8_0.gguf")
    assert path.endswith("b.Q8_0.gguf") and Path(path).read_bytes() == b"GGUF b"
    assert resolve_model("org/ggufs", gguf_file="b.Q8_0.gguf") == path
    assert hub.downloads == [("org/ggufs", "b.Q8_0.gguf")]
    with pytest.raises(ValueError, match="GGUF files only.*a.Q4_0.gguf, b.Q8_0.gguf"):
        resolve_model("org/ggufs")
    with pytest.raises(ValueError, match="no file 'c.gguf'.*a.Q4_0.gguf"):
        resolve_model("org/ggufs:c.gguf")


@pytest.mark.slow
def test_gguf_from_a_repo_generates_as_the_local_file(hub: FakeHub, smollm2_gguf) -> None:
    """A real GGUF (SmolLM2, its tokenizer and config inside) through the Hub path."""
    hub.repos["org/smol-gguf"] = repo = FakeRepo()
    repo.add({smollm2_gguf.name: smollm2_gguf.read_bytes(), "other.Q8_0.gguf": b"GGUF"},
             "main")
    with LLM(model=str(smollm2_gguf), seed=0) as local:
        expected = _greedy(local)
    with LLM(model=f"org/smol-gguf:{smollm2_gguf.name}", seed=0) as fetched:
        assert _greedy(fetched) == expected
    assert [path for _, path in hub.downloads] == [smollm2_gguf.name]


def test_names_a_local_path_wins_and_others_keep_their_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_model("org/tiny") == "org/tiny"  # no Hub asked: it would fail here
    for name in ("no-such-model", "a/b/c", "./x/y", "bad--name/x"):
        assert parse_hub_name(name) is None
        with pytest.raises(ValueError, match="neither a path"):
            resolve_model(name)
    assert parse_hub_name("org/name:f.gguf") == parse_hub_name("org/name", "f.gguf")
    with pytest.raises(ValueError, match="not a .gguf file"):
        parse_hub_name("org/name:weights.bin")
    with pytest.raises(ValueError, match="revision applies"):
        resolve_model("org/tiny", revision="main")
    with pytest.raises(ValueError, match="gguf_file must name"):
        EngineConfig(model="org/tiny", gguf_file="x.bin")


def test_file_selection() -> None:
    files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "tokenizer.json", "modules.json", "1_Pooling/config.json",
             "2_Dense/pytorch_model.bin", "2_Dense/config.json", "original/params.json",
             "consolidated.safetensors", "x.gguf", "onnx/model.onnx", "chat_template.jinja"]
    assert select_files(files) == [
        "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/pytorch_model.bin",
        "chat_template.jinja", "config.json", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "modules.json", "tokenizer.json"]
    assert "pytorch_model.bin" in select_files(["config.json", "pytorch_model.bin"])


def test_cli_says_why_in_one_line_and_serve_takes_the_model_as_argument(
        hub: FakeHub, tiny_checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    from quire.entrypoints.cli import build_parser, main, parse_args
    from quire.entrypoints.cli.engine_options import engine_config_from_args
    from quire.entrypoints.cli.serve import fetch_model_once

    assert main(["generate", "--model", "org/missing", "-p", "hi"]) == 2
    assert main(["serve", "org/missing", "--port", "0"]) == 2  # before anything starts
    lines = capsys.readouterr().err.strip().splitlines()
    for command, line in zip(("generate", "serve"), lines, strict=True):
        assert line.startswith(f"quire {command}: error: --model: model 'org/missing' is "
                               "neither"), line
    hub.repos["org/tiny"] = repo = _tiny_repo(tiny_checkpoint("llama"))
    args = parse_args(build_parser(), ["serve", "org/tiny", "--revision", "v2"])
    config = fetch_model_once(args, engine_config_from_args(args))
    assert (config.model, config.revision) == ("org/tiny", repo.refs["v2"])
    # API servers parse the command line again: they get the commit, and ask nothing
    assert args.argv[-2:] == ["--revision", repo.refs["v2"]]
    again = parse_args(build_parser(), args.argv)
    assert engine_config_from_args(again).revision == repo.refs["v2"]
