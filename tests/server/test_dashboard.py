"""``GET /dashboard`` end to end: two tiny models served by uvicorn in a thread, the page
opened in headless Chromium, traffic sent, and every figure the page shows (its table,
and the newest point of each chart) compared with figures computed here from our own
reads of ``/metrics``, with the same traffic paused between the page's polls.

The oracle is this file's own reading of the text (``prometheus_text``) and its own
``histogram_quantile``, written from PromQL's description. The browser tests skip, with
the reason, where Chromium, chromedriver or selenium is missing (``.ci/run`` installs
Debian's ``chromium chromium-driver``). Every wait is bounded.
"""

from __future__ import annotations

import math
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_text import parse, parse_labels
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import ServedModel, create_models_app
from quire.entrypoints.server.async_engine import AsyncEngine
from quire.entrypoints.server.slo import SLOTargets
from server_thread import Server

MODELS = ("alpha", "beta")
KEY = "secret"
ALL = "(all models)"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 60
SHARED = [(i % 40) + 5 for i in range(16)]  # a page's worth of prompt the requests share
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    # alpha misses its TTFT objective on every request and never its E2E one; beta has none
    slos = {"alpha": SLOTargets(ttft_s=1e-6, e2e_s=1000.0), "beta": None}
    served = [ServedModel(name, AsyncEngine(LLMEngine(EngineConfig.from_kwargs(
        path, device="cpu", max_model_len=128, block_size=16)), slo=slos[name]))
        for name in MODELS]
    srv = Server(create_models_app(served, api_key=KEY))
    yield srv
    srv.stop()


def metrics_text(server) -> str:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def send(server, model: str, prompt_len: int, max_tokens: int = 6) -> None:
    prompt = SHARED + [(i % 50) + 7 for i in range(prompt_len - len(SHARED))]
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text


def traffic(server, rounds: int = 2) -> None:
    """Requests of several prompt lengths to both models, some at once; returns when
    every one has finished and the engines are idle."""
    jobs = [(MODELS[i % 2], length) for i in range(rounds)
            for length in (20, 33, 50, 70, 100)] + [(MODELS[0], 40)] * 3
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda job: send(server, *job), jobs))
    wait_idle(server)


def wait_idle(server) -> str:
    import time

    deadline = time.monotonic() + WAIT_S
    while True:
        text = metrics_text(server)
        samples = parse(text)[0]
        busy = sum(v for (name, _), v in samples.items()
                   if name in ("quire:num_requests_running", "quire:num_requests_waiting",
                               "quire:num_kv_blocks_used"))
        if busy == 0:
            return text
        assert time.monotonic() < deadline, "the engines did not go idle"
        time.sleep(0.05)


# -- the oracle ----------------------------------------------------------------------------
def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """PromQL's ``histogram_quantile`` over (upper bound, cumulative count) pairs sorted
    by bound: linear within the bucket the rank falls in, the highest finite bound when
    it falls in +Inf, None without observations."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or not buckets[-1][1] > 0:
        return None
    rank = q * buckets[-1][1]
    for i, (bound, count) in enumerate(buckets[:-1]):
        if count >= rank:
            lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
            return lower + (bound - lower) * (rank - below) / (count - below)
    return buckets[-2][0]


class Reading:
    """One ``/metrics`` text, as (name, labels) samples in text order."""

    def __init__(self, text: str) -> None:
        self.samples = []
        for line in text.splitlines():
            if not line.startswith("#"):
                name, labels, value = _SAMPLE.fullmatch(line).groups()
                self.samples.append((name, parse_labels(labels) if labels else {},
                                     float(value)))

    def of(self, name: str, model: str) -> list[tuple[dict, float]]:
        return [(lbl, v) for n, lbl, v in self.samples
                if n == name and (model == ALL or lbl.get("model") == model)]

    def by(self, name: str, model: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for lbl, v in self.of(name, model):
            key = f'{label}="{lbl[label]}"'
            if model == ALL:
                key = f'model="{lbl["model"]}",{key}'
            out[key] = out.get(key, 0.0) + v
        return out

    def total(self, name: str, model: str) -> float:
        return sum(v for _, v in self.of(name, model))

    def buckets(self, name: str, model: str, group: str | None = None
                ) -> dict[str, dict[float, float]]:
        """Group (the ``group`` label's value, "" without one) -> bound -> count."""
        out: dict[str, dict[float, float]] = {}
        for lbl, v in self.of(name + "_bucket", model):
            counts = out.setdefault(lbl[group] if group else "", {})
            le = float(lbl["le"])
            counts[le] = counts.get(le, 0.0) + v
        return out


def interval_quantile(prev: Reading, cur: Reading, name: str, model: str, q: float,
                      group: str | None = None) -> dict[str, float | None]:
    """Per group, the ``q`` quantile of what ``name`` observed between the readings."""
    before, after = prev.buckets(name, model, group), cur.buckets(name, model, group)
    out = {}
    for key, counts in after.items():
        was = before.get(key, {})
        out[key] = histogram_quantile(q, sorted((le, n - was.get(le, 0.0))
                                               for le, n in counts.items()))
    return out


def expected(prev: Reading, cur: Reading, model: str, interval_s: float
             ) -> dict[str, float | None]:
    """What the page should show for ``model`` after polls that read ``prev``, ``cur``."""
    rows: dict[str, float | None] = {}
    for prefix, name in (("running", "quire:num_requests_running"),
                         ("waiting", "quire:num_requests_waiting"),
                         ("kv_cache_usage", "quire:kv_cache_usage_perc")):
        rows.update({f"{prefix}{{{k}}}": v for k, v in cur.by(name, model, "engine").items()})
    hits = [r.by("quire:prefix_cache_hits_total", model, "engine") for r in (prev, cur)]
    lookups = [r.by("quire:prefix_cache_queries_total", model, "engine") for r in (prev, cur)]
    for key, q in lookups[1].items():
        dq, dh = q - lookups[0][key], hits[1].get(key, 0.0) - hits[0].get(key, 0.0)
        rows[f"prefix_hit_rate{{{key}}}"] = dh / dq if dq > 0 else None
    for panel, name in (("ttft", "quire:time_to_first_token_seconds"),
                        ("itl", "quire:inter_token_latency_seconds")):
        for q in (50, 95, 99):
            rows[f"{panel}_p{q}"] = interval_quantile(prev, cur, name, model, q / 100)[""]
    rows["e2e_p95"] = interval_quantile(prev, cur, "quire:e2e_request_latency_seconds",
                                        model, 0.95)[""]
    for prefix, name in (("ttft_p95", "quire:time_to_first_token_by_prompt_len_seconds"),
                         ("queue_p95", "quire:request_queue_time_by_prompt_len_seconds")):
        bands = interval_quantile(prev, cur, name, model, 0.95, "prompt_len_le")
        rows.update({f'{prefix}{{prompt_len_le="{band}"}}': v for band, v in bands.items()})
    for kind in ("prompt", "generation"):
        name = f"quire:{kind}_tokens_total"
        rows[f"{kind}_tokens_per_s"] = (cur.total(name, model) - prev.total(name, model)) \
            / interval_s
        rows[f"{kind}_tokens_total"] = cur.total(name, model)
    rows.update({f"processes{{{k}}}": v
                 for k, v in cur.by("quire:processes", model, "role").items()})
    missed = [r.by("quire:request_slo_missed_total", model, "slo") for r in (prev, cur)]
    for key, v in missed[1].items():
        rows[f"slo_missed_per_s{{{key}}}"] = (v - missed[0][key]) / interval_s
        rows[f"slo_missed_total{{{key}}}"] = v
    return rows


def over_interval(key: str) -> bool:
    """Whether the page's figure ``key`` is a rate or percentile between two polls."""
    base = key.partition("{")[0]
    return base.endswith("_per_s") or base == "prefix_hit_rate" \
        or re.search(r"_p\d+$", base) is not None


def assert_rows_match(shown: dict[str, str], want: dict[str, float | None],
                      keys: set[str] | None = None) -> None:
    keys = set(want) if keys is None else keys
    assert keys <= set(shown), sorted(keys - set(shown))
    for key in sorted(keys):
        if want[key] is None:
            assert shown[key] == "", (key, shown[key])
        else:
            assert shown[key] != "" and float(shown[key]) == pytest.approx(
                want[key], rel=1e-9, abs=1e-12), (key, shown[key], want[key])


# -- the route, without a browser ------------------------------------------------------------
def test_the_page_and_its_assets_are_served_without_a_key_and_nothing_else(server):
    page = httpx.get(server.url + "/dashboard", timeout=30)  # no API key, as /metrics
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    for name, kind in (("uPlot.iife.min.js", "text/javascript"),
                       ("uPlot.min.css", "text/css"), ("dashboard.js", "text/javascript")):
        assert f'"dashboard/{name}"' in page.text
        r = httpx.get(f"{server.url}/dashboard/{name}", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
    for missing in ("README.md", "uPlot.LICENSE", "..%2Fapp.py", "nope.js"):
        assert httpx.get(f"{server.url}/dashboard/{missing}", timeout=30).status_code == 404


# -- in Chromium ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (the test extra)")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).exists():
            pytest.skip(f"{path} is missing (apt-get install {package})")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1400,1500",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


_READ = """
const charts = {};
for (const [id, c] of Object.entries(window.quireDashboard.state.charts)) {
  charts[id] = c.plot ? c.keys.map((k, i) => [k, c.plot.data[i + 1].at(-1)]) : null;
}
return {polls: document.body.dataset.polls, interval: document.body.dataset.interval,
        model: document.body.dataset.model,
        models: Array.from(document.querySelectorAll('#model option')).map(o => o.value),
        rows: Array.from(document.querySelectorAll('#latest tr[data-key]'))
                   .map(r => [r.dataset.key, r.dataset.value]),
        charts: charts, status: document.getElementById('status').textContent};
"""


def read_page(driver) -> dict:
    """The page's figures, table and charts, in one script: one consistent moment."""
    return driver.execute_script(_READ)


def wait_for(driver, condition, what: str) -> dict:
    """The first reading of the page that meets ``condition``."""
    from selenium.webdriver.support.ui import WebDriverWait

    def met(d) -> dict | None:
        page = read_page(d)
        return page if condition(page) else None

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(met, message=what)


def check_charts(page: dict) -> None:
    """Each chart's newest point is its row's value in the table."""
    shown = dict(page["rows"])
    assert set(page["charts"]) == {"requests", "kv", "prefix", "ttft", "itl", "tokens",
                                   "processes", "slo", "ttft_bands", "queue_bands"}
    for panel, series in page["charts"].items():
        assert series, panel
        for key, value in series:
            if value is None:
                assert shown[key] == "", (panel, key)
            else:
                assert float(shown[key]) == pytest.approx(value, rel=1e-12), (panel, key)


def test_the_page_shows_what_metrics_says(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(server.url + "/dashboard?interval=0")  # polls on load, then on Refresh
    wait_for(browser, lambda p: p["polls"] == "1", "the first poll")
    before = Reading(wait_idle(server))
    traffic(server)
    after = Reading(wait_idle(server))
    browser.find_element(By.ID, "refresh").click()
    page = wait_for(browser, lambda p: p["polls"] == "2", "the poll on Refresh")
    assert page["models"] == [*MODELS, ALL] and page["model"] == MODELS[0]
    interval = float(page["interval"])
    for model in (*MODELS, ALL):
        if model != page["model"]:
            Select(browser.find_element(By.ID, "model")).select_by_value(model)
            page = wait_for(browser, lambda p, m=model: p["model"] == m, model)
        want = expected(before, after, model, interval)
        shown = dict(page["rows"])
        assert set(shown) == set(want), model
        assert_rows_match(shown, want)
        check_charts(page)
        # the traffic shows: tokens, latencies, prefix hits (every request shares a page)
        assert want["generation_tokens_per_s"] > 0 and want["ttft_p95"] is not None
        assert want["itl_p50"] is not None
        # the prompts fall in three bands (20 and 33 | 40 and 50 | 70 and 100 tokens)
        assert sum(k.startswith("ttft_p95{") and v is not None for k, v in want.items()) >= 3
    assert any(v for k, v in want.items() if k.startswith("prefix_hit_rate"))
    assert want['running{model="alpha",engine="0"}'] == 0
    # alpha's every request missed its TTFT objective, none its E2E one; beta has none
    assert want['slo_missed_total{model="alpha",slo="ttft"}'] > 0
    assert want['slo_missed_total{model="alpha",slo="e2e"}'] == 0
    assert not any('model="beta",slo' in k for k in want)


def test_the_page_polls_by_itself_and_catches_up(server, browser, tmp_path):
    browser.get(server.url + f"/dashboard?interval=0.2&model={MODELS[1]}")
    wait_for(browser, lambda p: int(p["polls"] or 0) >= 2, "two polls")
    traffic(server, rounds=1)
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    now = Reading(wait_idle(server))
    # gauges and totals: the page reaches what /metrics says once it polled after the
    # traffic (rates and percentiles depend on when its polls fell)
    want = expected(now, now, MODELS[1], 1.0)
    steady = {k for k in want if not over_interval(k)}

    def caught_up(page: dict) -> bool:
        shown = dict(page["rows"])
        return page["model"] == MODELS[1] and all(
            shown.get(k) not in (None, "") and float(shown[k]) == want[k] for k in steady)

    page = wait_for(browser, caught_up, "the page's figures reach /metrics'")
    assert_rows_match(dict(page["rows"]), want, steady)
    check_charts(page)
    assert page["status"].startswith("polled")
