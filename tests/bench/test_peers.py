"""The peer machinery: workers import only what their venv has, memory readings, model
files, and (when the hf venv is installed) the hf worker for real on the tiny model."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from quire.bench.peers import procmem
from quire.bench.peers.models import model_variants
from quire.bench.peers.runner import PeerError, job_runs, measure
from quire.bench.peers.spec import PEERS
from quire.bench.throughput import ThroughputRun
from quire.bench.workloads import PRESETS, build_requests

PEERS_DIR = Path(procmem.__file__).parent
SHARED = {"worker_io", "clock", "procmem"}
PEER_LIBRARIES = {"hf_worker.py": {"torch", "transformers"}, "vllm_worker.py": {"vllm"},
                  "llamacpp_worker.py": {"llama_cpp"},
                  # one worker for the hf and vllm peers: each imports only its own
                  "image_worker.py": {"PIL", "torch", "transformers", "vllm"}}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("name", [*sorted(PEER_LIBRARIES), *(f"{m}.py" for m in SHARED)])
def test_workers_need_only_the_standard_library_and_their_peer(name):
    allowed = set(sys.stdlib_module_names) | SHARED | PEER_LIBRARIES.get(name, set())
    assert imported_roots(PEERS_DIR / name) <= allowed


def test_every_peer_has_its_worker_and_install_steps():
    for spec in PEERS.values():
        assert spec.worker.is_file()
        assert spec.install_steps and spec.install_steps[0][0] == "install"
        assert spec.venv().name == spec.name and spec.venv().parent.name == "peers"
    assert PEERS["vllm"].env == {"VLLM_CPU_KVCACHE_SPACE": "4",
                                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_peak_rss_covers_child_processes():
    own = procmem.peak_rss_bytes(include_children=False)
    assert own is not None and own > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while procmem.peak_rss_bytes() <= procmem.peak_rss_bytes(include_children=False):
            assert time.monotonic() < deadline, "the child never showed up"
            time.sleep(0.05)
        assert child.pid in procmem.descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert isinstance(procmem.reset_peak_rss(), bool)


def test_model_files_per_peer(tmp_path, tiny_path):
    assert model_variants(PEERS["hf"], tiny_path) == [("hf", tiny_path)]
    with pytest.raises(PeerError, match="needs a .gguf model"):
        model_variants(PEERS["llamacpp"], tiny_path)


def test_jobs_carry_ids_and_lengths(tiny_corpus):
    spec = PRESETS["W1"].with_overrides(num_requests=2, input_len=5, output_len=3)
    runs = [build_requests(spec, tiny_corpus, r) for r in range(2)]
    jobs = job_runs(runs)
    assert len(jobs) == 2 and len(jobs[0]) == 2
    assert jobs[0][0] == {"prompt_token_ids": list(runs[0][0].prompt_token_ids),
                          "output_len": 3}


@pytest.mark.slow
@pytest.mark.skipif(not PEERS["hf"].python().exists(), reason="the hf peer is not installed")
def test_hf_worker_runs_the_tiny_model(tiny_path, tiny_corpus):
    spec = PRESETS["W1"].with_overrides(num_requests=3, input_len=10, output_len=4)
    runs = [build_requests(spec, tiny_corpus, r) for r in range(2)]
    result = measure(PEERS["hf"], "throughput", "hf", tiny_path, runs, timeout_s=600)
    assert "transformers" in result.description
    assert [type(r) for r in result.runs] == [ThroughputRun, ThroughputRun]
    assert all(r.output_tokens == 12 and r.prompt_tokens == 30 for r in result.runs)
    latency = measure(PEERS["hf"], "latency", "hf", tiny_path, runs[:1], timeout_s=600)
    timings = latency.runs[0].requests
    assert [t.output_tokens for t in timings] == [4, 4, 4]
    assert all(len(t.itl_s) == 3 and t.ttft_s > 0 for t in timings)
    # it runs at the dtype it is given (Quire's), on the device given
    half = measure(PEERS["hf"], "throughput", "hf", tiny_path, runs[:1],
                   options={"device": "cpu", "dtype": "bfloat16"}, timeout_s=600)
    assert "bfloat16" in half.description and half.runs[0].output_tokens == 12
