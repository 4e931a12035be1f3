"""``quire bench abuse`` end to end with tiny counts: against an in-process server
(``--url``), and (slow) against a ``quire serve`` it starts itself. No timing is
asserted: only that both phases run and the record holds what the note needs."""

from __future__ import annotations

import json
import os

import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.cli import main
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from server_thread import Server, wait_idle

TINY = ["--clients", "4", "--input-len", "8", "--output-len", "4", "--warmup", "0",
        "--non-readers", "1", "--slow-headers", "1", "--max-stop-clients", "1",
        "--max-fanout-clients", "1", "--slow-interval", "0.2"]


@pytest.fixture(scope="module")
def server(tiny_path):
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_path, device="cpu", max_model_len=128))
    aengine = AsyncEngine(engine, max_waiting_requests=10_000)
    srv = Server(create_app(aengine, "tiny"), aengine)
    yield srv
    srv.stop()


def check_record(result: dict, clients: int) -> None:
    assert result["command"] == "abuse"
    for phase in ("abused", "alone"):
        median = result["results"][phase]["median"]
        assert median["completed"] == clients and median["errors"] == 0, median
        assert median["ttft_s_p95"] > 0 and median["e2e_s_p50"] > 0
        assert median["peak_rss_mib"] > 0
    ratios = result["ratios"]["abused/alone"]
    assert ratios["ttft_s_p50"] > 0 and ratios["e2e_s_p95"] > 0
    assert set(result["abusers"]) == {"non_reader", "slow_header", "max_stop", "max_fanout"}
    assert sum(result["abusers"]["non_reader"].values()) == 1


@pytest.mark.slow  # a real server under the abusive mix: about half a minute
def test_against_a_running_server(capsys, tmp_path, tiny_path, server):
    out = tmp_path / "abuse.json"
    argv = ["bench", "abuse", "--url", server.url, "--server-pid", str(os.getpid()),
            "--model", tiny_path, *TINY, "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "TTFT p95 (ms)" in printed and "abused/alone" in printed
    check_record(json.loads(out.read_text()), clients=4)
    wait_idle(server, timeout=20.0)


@pytest.mark.slow
def test_starts_its_own_server(capsys, tmp_path, tiny_path):
    out = tmp_path / "abuse.json"
    argv = ["bench", "abuse", "--model", tiny_path, "--serve-args=--device cpu", *TINY,
            "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    check_record(result, clients=4)
    assert result["settings"]["server_pid"] is not None
