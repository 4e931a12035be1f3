"""``quire serve``: the OpenAI-compatible HTTP server (uvicorn) over one engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quire.cli.common import UsageError, open_registry
from quire.cli.engine_options import add_engine_options, engine_config_from_args

if TYPE_CHECKING:
    from quire.server.async_engine import AsyncEngine


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and friends.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests queued beyond this get HTTP 503")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: --model)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file, instead of the tokenizer's")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="for quire's and uvicorn's logs; 'info' writes one access "
                             "line per request")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight requests may run on "
                             "before they are aborted")
    add_engine_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from quire.engine import LLMEngine
    from quire.server.app import create_app
    from quire.server.async_engine import AsyncEngine

    _configure_logging(args.log_level)
    if args.shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout: must be >= 0")
    if args.max_waiting_requests < 1:
        raise UsageError("--max-waiting-requests: must be >= 1")
    template = Path(args.chat_template).read_text() if args.chat_template else None
    config = engine_config_from_args(args)
    try:
        engine = LLMEngine(config, open_registry(args))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    async_engine = AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests)
    app = create_app(async_engine,
                     args.served_model_name or args.model, api_key=args.api_key,
                     chat_template=template)
    # On SIGINT/SIGTERM uvicorn stops accepting, waits for connections to close, runs
    # the app's lifespan shutdown (which joins the engine thread) and returns; its own
    # timeout is only a backstop, as the drain ends every stream first. Our AccessLog
    # middleware writes the access lines (with request id and tokens), so uvicorn's own
    # access log is off.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    _graceful_server_class()(config, async_engine, args.shutdown_timeout).run()
    return 0


def _graceful_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server with Quire's stop on SIGTERM/SIGINT.

        On the first signal the engine is drained (new requests refused, in-flight ones
        given ``drain_s`` to finish, the rest aborted so that their streams end with
        finish reason "abort" rather than a cut connection); uvicorn then closes the
        idle connections and runs the app's shutdown. The process exits with status 0:
        uvicorn would re-raise the signal after its shutdown, so that the process dies
        "of" it, while an orderly stop is a success.
        """

        def __init__(self, config: Any, engine: AsyncEngine, drain_s: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.drain_s = drain_s
            self.loop: asyncio.AbstractEventLoop | None = None
            self.draining: asyncio.Future[None] | None = None

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining is None and self.loop is not None:
                self.loop.call_soon_threadsafe(self._start_drain)
            super().handle_exit(sig, frame)

        def _start_drain(self) -> None:
            if self.draining is None:
                self.draining = asyncio.ensure_future(self.engine.drain(self.drain_s))

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            saved = {sig: signal.signal(sig, self.handle_exit)
                     for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _configure_logging(level: str) -> None:
    """quire's loggers (engine, access lines) at ``level`` on stderr, uvicorn's style."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("quire")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
