"""A screenshot of ``quire serve``'s ``/dashboard`` under traffic (docs/images/dashboard.png).

Starts ``quire serve`` on ``--model`` (with ``--slo-ttft``, so the SLO panels have
something to show), sends completions of several prompt lengths from ``--clients``
threads for ``--seconds``, with the page open in headless Chromium polling every second,
and saves the screenshot before the traffic ends. Needs Debian's ``chromium`` and
``chromium-driver`` and ``selenium``.

    python scripts/dashboard_screenshot.py --out docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def start_server(model: str, serve_args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``quire serve`` on a free port; the process and its URL (from the start line)."""
    proc = subprocess.Popen([sys.executable, "-m", "quire.entrypoints.cli", "serve",
                             "--model", model, "--port", "0", *serve_args],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"running on (http://\S+)", line, re.IGNORECASE)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            return proc, match.group(1)
    raise SystemExit(f"quire serve exited with {proc.wait()}")


def clients(url: str, model: str, count: int, stop: threading.Event) -> list[threading.Thread]:
    """``count`` threads sending completions of 20 to 400 words until ``stop``."""
    def client(i: int) -> None:
        lengths = (20, 60, 150, 400)
        n = i
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                words = " ".join(f"word{k % 97}" for k in range(lengths[n % len(lengths)]))
                http.post(url + "/v1/completions", json={
                    "model": model, "prompt": "Summarize: " + words, "max_tokens": 32,
                    "temperature": 0.7, "ignore_eos": True})
                n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def screenshot(url: str, out: str, seconds: float, chromium: str, chromedriver: str) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    with tempfile.TemporaryDirectory() as profile:
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1400,2200", f"--user-data-dir={profile}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(chromedriver), options=options)
        try:
            driver.get(url + "/dashboard?interval=1")
            time.sleep(seconds)  # a picture of some history, not a condition to wait for
            driver.save_screenshot(out)
        finally:
            driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--out", default="docs/images/dashboard.png")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--slo-ttft", default="0.5")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args()
    proc, url = start_server(args.model, ["--slo-ttft", args.slo_ttft,
                                          "--served-model-name", "smollm2"])
    stop = threading.Event()
    try:
        threads = clients(url, "smollm2", args.clients, stop)
        screenshot(url, args.out, args.seconds, args.chromium, args.chromedriver)
        stop.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=60)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
