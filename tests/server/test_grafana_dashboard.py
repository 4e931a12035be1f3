"""``examples/grafana/quire.json`` queries only what the server exports: every metric
its PromQL names is a sample of a tiny server's ``/metrics`` (with SLOs set and a
request served, so that every family has samples), and every label its queries group
by or name in a legend is a label of those samples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_text import parse
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from quire.entrypoints.server.slo import SLOTargets
from server_thread import Server

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "quire.json"
NAME = re.compile(r"\bquire:[a-zA-Z0-9_:]+")
BY = re.compile(r"\bby \(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SELECTOR = re.compile(r"\{(\w+)=~")


@pytest.fixture(scope="module")
def exported(tiny_checkpoint) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a served tiny model."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=64))
    aengine = AsyncEngine(engine, slo=SLOTargets(ttft_s=30.0, e2e_s=60.0))
    server = Server(create_app(aengine, "tiny"))
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    names: dict[str, set[str]] = {}
    for name, labels in parse(text)[0]:
        names.setdefault(name, set()).update(key for key, _ in labels)
    return names


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard: panel targets and variables."""
    board = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p['title']!r}", t["expr"]) for p in board["panels"]
             for t in p["targets"]]
    found += [(f"variable {v['name']!r}", v["query"]["query"])
              for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_metric_the_dashboard_queries_is_exported(exported):
    named = set()
    for where, expr in queries():
        names = NAME.findall(expr)
        assert names, f"{where} names no quire metric: {expr}"
        missing = [n for n in names if n not in exported]
        assert not missing, f"{where} queries {missing}, which /metrics does not export"
        named.update(names)
    # the page's panels are all there
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "prompt_tokens_total",
                   "generation_tokens_total", "processes", "request_slo_missed_total",
                   "time_to_first_token_by_prompt_len_seconds_bucket",
                   "request_queue_time_by_prompt_len_seconds_bucket"):
        assert f"quire:{family}" in named, family


def test_every_label_the_dashboard_uses_is_on_its_metrics(exported):
    board = json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            labels = {label.strip() for group in BY.findall(expr)
                      for label in group.split(",")} - {"le"}
            labels |= set(LEGEND.findall(target["legendFormat"])) | set(SELECTOR.findall(expr))
            for name in NAME.findall(expr):
                have = exported[name]
                assert labels <= have, (panel["title"], name, labels - have)
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
