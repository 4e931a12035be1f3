"""The in-process server harness: uvicorn in a daemon thread on an ephemeral port, over
an engine whose steps a test can slow down or hold (to catch a request mid-run)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn
from quire.engine import LLMEngine
from quire.entrypoints.server.async_engine import AsyncEngine


class Server:
    """uvicorn serving ``app`` in a daemon thread on an ephemeral port; ``config_kw`` are
    further ``uvicorn.Config`` options (``http``, ``limit_concurrency``, ...)."""

    def __init__(self, app: Any, engine: AsyncEngine | None = None, **config_kw: Any) -> None:
        self.engine = engine
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                log_level="warning", **config_kw))
        self.uv.install_signal_handlers = lambda: None  # signals belong to the main thread
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no start"
            time.sleep(0.02)
        port = self.uv.servers[0].sockets[0].getsockname()[1]  # port 0: read it back
        self.url = f"http://127.0.0.1:{port}"

    def stats(self) -> Any:
        assert self.engine is not None
        fut = asyncio.run_coroutine_threadsafe(self.engine.stats(), self.engine.loop)
        return fut.result(timeout=10)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


class SteppedEngine:
    """Wraps ``engine.step`` so a test can slow each step (``step_delay[0]`` seconds) or,
    while ``hold`` is set, let one step run and then hold the engine thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.step_delay = [0.0]
        self.hold = threading.Event()
        self.steps_since_hold = [0]
        fast_step = engine.step

        def step(final_only: bool = False, timeout: float = 0.1) -> Any:
            while self.hold.is_set() and self.steps_since_hold[0] >= 1:
                time.sleep(0.005)
            if self.hold.is_set():
                self.steps_since_hold[0] += 1
            time.sleep(self.step_delay[0])
            return fast_step(final_only, timeout)

        engine.step = step  # type: ignore[method-assign]


def serve_stepped(engine: LLMEngine, make_app: Any, **engine_kw: Any) -> Server:
    """A :class:`Server` over ``engine`` with :class:`SteppedEngine` controls attached
    (``step_delay``, ``hold``, ``steps_since_hold``, ``block_manager``)."""
    controls = SteppedEngine(engine)
    aengine = AsyncEngine(engine, **engine_kw)
    srv = Server(make_app(aengine), aengine)
    srv.step_delay = controls.step_delay  # type: ignore[attr-defined]
    srv.hold = controls.hold  # type: ignore[attr-defined]
    srv.steps_since_hold = controls.steps_since_hold  # type: ignore[attr-defined]
    srv.block_manager = engine.core.block_manager  # type: ignore[attr-defined]
    return srv


def wait_idle(server: Server, timeout: float = 10.0) -> Any:
    """Wait until no page is held and nothing is unfinished; the stats then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats.num_used_blocks == 0 and not stats.has_unfinished:
            return stats
        assert time.monotonic() < deadline, f"pages still held: {stats}"
        time.sleep(0.05)
