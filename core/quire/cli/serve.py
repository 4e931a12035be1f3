"""``quire serve``: the OpenAI-compatible HTTP server (uvicorn) over one engine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from quire.cli.common import UsageError, open_registry
from quire.cli.engine_options import add_engine_options, engine_config_from_args


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
                        choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from quire.engine import LLMEngine
    from quire.server.app import create_app
    from quire.server.async_engine import AsyncEngine

    if args.max_waiting_requests < 1:
        raise UsageError("--max-waiting-requests: must be >= 1")
    template = Path(args.chat_template).read_text() if args.chat_template else None
    config = engine_config_from_args(args)
    try:
        engine = LLMEngine(config, open_registry(args))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    app = create_app(AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests),
                     args.served_model_name or args.model, api_key=args.api_key,
                     chat_template=template)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, runs the app's lifespan
    # shutdown (which drains, aborts and joins the engine thread) and returns.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
