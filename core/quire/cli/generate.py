"""``quire generate``: run prompts through the offline engine and print the completions."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from quire.cli.common import UsageError, open_registry
from quire.cli.engine_options import add_engine_options, engine_config_from_args


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate greedy completions for the given prompts and print them.",
    )
    parser.add_argument("--prompt", "-p", action="append", dest="prompts", metavar="TEXT",
                        help="a prompt; repeat for a batch (default: read lines from stdin)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_engine_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quire.engine import LLMEngine
    from quire.llm import LLM
    from quire.sampling_params import SamplingParams

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise UsageError("--prompt: give at least one prompt (or lines on stdin)")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except ValueError as exc:
        raise UsageError(f"--max-tokens: {exc}") from exc
    config = engine_config_from_args(args)
    registry = open_registry(args)
    started = time.perf_counter()
    try:
        llm = LLM.from_engine(LLMEngine(config, registry))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    loaded = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    done = time.perf_counter()
    for out in outputs:
        completion = out.outputs[0]
        print(f"{out.prompt!r} -> {completion.text!r}  [{completion.finish_reason}]")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"quire: {llm.engine.platform.name}, loaded in {loaded - started:.1f}s; "
          f"{tokens} tokens in {done - loaded:.2f}s", file=sys.stderr)
    return 0
