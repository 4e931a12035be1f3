"""Every ``quire bench`` subcommand end to end on the tiny model, in seconds.

No timing is asserted: only that each command runs, prints its table and writes the
JSON (and the plot) it promises.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from quire.bench.peers.runner import PeerError, check_installed
from quire.bench.peers.spec import PEERS
from quire.bench.sweep import SWEEPABLE
from quire.entrypoints.cli import build_parser, main, parse_args
from quire.entrypoints.cli.bench import SWEEP_OPTIONS, require
from quire.entrypoints.cli.common import UsageError

SMALL = ["--device", "cpu", "--num-requests", "3", "--input-len", "12", "--output-len", "4",
         "--repeats", "2", "--kv-cache-memory", "4MiB"]


def run_json(capsys, tmp_path, argv):
    out = tmp_path / "result.json"
    assert main([*argv, "--output", str(out)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out, json.loads(out.read_text())


def test_throughput(capsys, tmp_path, tiny_path):
    out, result = run_json(capsys, tmp_path, ["bench", "throughput", "--model", tiny_path,
                                              *SMALL])
    assert "output tokens/s" in out and "peak RSS (MiB)" in out
    quire = result["results"]["quire"]
    assert len(quire["runs"]) == 2  # the warm-up run is not among them
    assert result["settings"]["warmup"] == 1
    assert quire["median"]["requests_per_s"] > 0
    assert result["settings"]["workload"]["num_requests"] == 3
    assert result["command"] == "throughput" and result["timestamp"]


def test_latency(capsys, tmp_path, tiny_path):
    out, result = run_json(capsys, tmp_path, ["bench", "latency", "--model", tiny_path,
                                              *SMALL])
    assert "TTFT p50 (ms)" in out and "ITL p95 (ms)" in out
    assert result["results"]["quire"]["median"]["ttft_s_p50"] > 0


def test_sweep_with_plot(capsys, tmp_path, tiny_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    plot = tmp_path / "sweep.png"
    out, result = run_json(capsys, tmp_path, [
        "bench", "sweep", "--model", tiny_path, *SMALL, "--repeats", "1",
        "--block-size", "8,16", "--max-num-seqs", "4", "--plot", str(plot)])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p["value"] for p in result["points"]] == [8, 16]
    assert "max_num_seqs=4" in result["points"][0]["description"]
    assert out.splitlines()[1].startswith("block-size")


def test_sweep_leaves_the_other_options_at_their_defaults(capsys, tmp_path, tiny_path):
    """Only the swept option given: the others are EngineConfig's defaults (it used to
    pass max_num_seqs=None and fail)."""
    _, result = run_json(capsys, tmp_path, [
        "bench", "sweep", "--model", tiny_path, *SMALL, "--repeats", "1",
        "--max-num-batched-tokens", "64,128"])
    assert [p["value"] for p in result["points"]] == [64, 128]
    assert "max_num_seqs=256" in result["points"][0]["description"]


def test_sweep_needs_one_list(capsys, tiny_path):
    assert main(["bench", "sweep", "--model", tiny_path, "--block-size", "16"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    assert SWEEP_OPTIONS == SWEEPABLE


def test_a_missing_extra_names_the_install_command():
    with pytest.raises(UsageError, match=r"pip install -e '\.\[bench\]'"):
        require("no_such_module_for_quire_tests", "--plot")


def test_memory_needs_no_model(capsys, tmp_path):
    out, result = run_json(capsys, tmp_path, ["bench", "memory", "--kv-memory", "4096tok"])
    assert [p["policy"] for p in result["policies"]] == [
        "paged", "contiguous (max_model_len)", "contiguous (prompt+max_tokens)"]
    paged, at_max = result["policies"][:2]
    assert paged["peak_concurrency"] > at_max["peak_concurrency"]
    assert "wasted share of held KV" in out


def test_memory_flags_come_from_a_config_file(tmp_path):
    config = tmp_path / "mem.yaml"
    config.write_text("kv-memory: 2048tok\nblock-size: 32\n")
    args = parse_args(build_parser(), ["bench", "memory", "--config", str(config),
                                       "--block-size", "8"])
    assert args.kv_memory == "2048tok" and args.block_size == 8  # the command line wins


def test_missing_peer_names_its_install_command(capsys, tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path))
    with pytest.raises(PeerError, match="quire bench install-peer vllm"):
        check_installed(PEERS["vllm"])
    # refused before anything runs
    assert main(["bench", "throughput", "--model", tiny_path, "--peer", "llamacpp"]) == 2
    assert "quire bench install-peer llamacpp" in capsys.readouterr().err


def test_hf_peer_follows_quires_device_and_dtype(capsys, tmp_path, monkeypatch, tiny_path):
    """The hf peer is asked to run where Quire ran, at its dtype (no peer process here)."""
    from quire.bench.peers import runner

    jobs = []

    def fake_worker(spec, job, timeout_s=None):
        jobs.append(job)
        return {"engine": "fake", "runs": [
            {"elapsed_s": 1.0, "num_requests": 3, "prompt_tokens": 36, "output_tokens": 12,
             "peak_rss_bytes": None} for _ in job["runs"]]}

    monkeypatch.setattr(runner, "check_installed", lambda spec: tmp_path)
    monkeypatch.setattr(runner, "run_worker", fake_worker)
    argv = ["bench", "throughput", "--model", tiny_path, *SMALL, "--dtype", "bfloat16",
            "--peer", "hf"]
    assert main(argv) == 0, capsys.readouterr().err
    assert [j["options"]["device"] for j in jobs] == ["cpu"]
    assert [j["options"]["dtype"] for j in jobs] == ["bfloat16"]


class _Server:
    """Our server in a thread on an ephemeral port (as tests/server does)."""

    def __init__(self, model_path: str) -> None:
        import uvicorn
        from quire.config import EngineConfig
        from quire.engine import LLMEngine
        from quire.entrypoints.server.app import create_app
        from quire.entrypoints.server.async_engine import AsyncEngine

        engine = LLMEngine(EngineConfig.from_kwargs(model_path, device="cpu",
                                                    kv_cache_memory=4 << 20))
        app = create_app(AsyncEngine(engine, max_waiting_requests=64), "tiny")
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                log_level="warning"))
        self.uv.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.uv.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def server(tiny_path):
    srv = _Server(tiny_path)
    yield srv
    srv.stop()


@pytest.mark.parametrize("load", [["--concurrency", "2"], ["--request-rate", "50"]])
def test_serve_against_our_server(capsys, tmp_path, tiny_path, server, load):
    out, result = run_json(capsys, tmp_path, [
        "bench", "serve", "--url", server.url, "--model", tiny_path, "--num-requests", "4",
        "--input-len", "10", "--output-len", "5", "--repeats", "1", "--slo-ttft", "60",
        *load])
    median = result["results"]["server"]["median"]
    assert median["completed"] == 4 and median["errors"] == 0
    assert median["overloaded_503"] == 0
    assert median["goodput_requests_per_s"] == pytest.approx(median["requests_per_s"])
    assert median["ttft_s_p99"] >= median["ttft_s_p50"] > 0
    assert result["settings"]["model"] == "tiny"  # from /v1/models
    assert median["usage_prompt_match"] == 1.0  # our server counts the text as we do
    assert "goodput" in out


def test_serve_reports_an_unreachable_server(capsys, tiny_path):
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", tiny_path,
               "--num-requests", "1", "--input-len", "8", "--output-len", "2",
               "--repeats", "1", "--served-model-name", "x", "--timeout", "5"])
    assert rc == 0  # every request failed, and the table says so
    assert "other errors" in capsys.readouterr().out


def test_serve_steps_concurrency_and_reports_the_capacity(capsys, tmp_path, tiny_path,
                                                          server):
    base = ["bench", "serve", "--url", server.url, "--model", tiny_path, "--num-requests",
            "4", "--input-len", "10", "--output-len", "3", "--repeats", "1"]
    out, result = run_json(capsys, tmp_path, [*base, "--concurrency", "1,2",
                                              "--slo-ttft", "60", "--slo-e2e", "120"])
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert all(lv["met"] and lv["median"]["completed"] == 4 for lv in result["levels"])
    assert result["capacity"] == 2 and "capacity: 2 concurrent at p95" in out
    # an objective no server meets: the first level misses, and the search stops there
    out, result = run_json(capsys, tmp_path, [*base, "--concurrency", "1,2,4",
                                              "--slo-ttft", "1e-9"])
    assert [lv["met"] for lv in result["levels"]] == [False]
    assert result["capacity"] is None and "no level tried meets" in out


@pytest.mark.parametrize("flags, words", [
    (["--concurrency", "1,2"], "--slo-ttft"),
    (["--concurrency", "2,1", "--slo-ttft", "1"], "increase"),
    (["--concurrency", "1,x", "--slo-ttft", "1"], "'x'"),
    (["--concurrency", "1,8", "--slo-ttft", "1"], "--num-requests"),
])
def test_serve_refuses_bad_concurrency_levels_naming_the_flag(capsys, tiny_path, flags,
                                                               words):
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", tiny_path,
               "--num-requests", "4", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "--concurrency: " in err and words in err, err
