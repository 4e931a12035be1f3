"""``quire generate``: run prompts through the offline engine and print the completions."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from quire.entrypoints.cli.common import (
    UsageError,
    open_registry,
    read_chat_template,
    resolve_device,
)
from quire.entrypoints.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
    engine_error,
)


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate a completion for each prompt and print them: greedy by "
                    "default (--temperature 0), sampled with --temperature above 0 (then "
                    "--top-p, --top-k and --sampling-seed apply).",
    )
    parser.add_argument("--prompt", "-p", action="append", dest="prompts", metavar="TEXT",
                        help="a prompt; repeat for a batch (default: read lines from stdin)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens per completion (default: %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 decodes greedily; above 0 samples (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="keep the k likeliest; 0: all (default: %(default)s)")
    parser.add_argument("--sampling-seed", type=int, default=None, metavar="SEED",
                        help="per-request seed for reproducible sampling (default: none, "
                             "the engine's generator)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="a stop string; repeat for several")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the model's chat template")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="with --chat, a Jinja chat template file, for a model that has "
                             "none (or instead of its own) (default: the tokenizer's)")
    add_engine_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quire.engine import LLMEngine
    from quire.entrypoints.llm import LLM
    from quire.sampling_params import SamplingParams

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise UsageError("--prompt: give at least one prompt (or lines on stdin)")
    if args.chat_template is not None and not args.chat:
        raise UsageError("--chat-template: applies with --chat, which is not given")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise UsageError(f"--{field.replace('_', '-')}: {exc}") from exc
    config = engine_config_from_args(args)
    template = read_chat_template(args.chat_template)
    registry = open_registry(args)
    resolve_device(registry, config.device)
    started = time.perf_counter()
    try:
        llm = LLM.from_engine(LLMEngine(config, registry))
    except (ValueError, RuntimeError) as exc:
        raise engine_error(exc) from exc
    loaded = time.perf_counter()
    try:
        if args.chat:
            _check_chat_template(llm, template)
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               chat_template=template)
        else:
            outputs = llm.generate(prompts, params)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    done = time.perf_counter()
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        shown = prompts[i] if args.chat else out.prompt
        print(f"{shown!r} -> {completion.text!r}  [{completion.finish_reason}]")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"quire: {llm.engine.info.platform_name}, loaded in {loaded - started:.1f}s; "
          f"{tokens} tokens in {done - loaded:.2f}s", file=sys.stderr)
    return 0


def _check_chat_template(llm: Any, template: str | None) -> None:
    """:raises UsageError: naming the flags, for ``--chat`` with a model that has no chat
    template (a base model: built-in gemma3-270m) and no ``--chat-template``."""
    if template is None and not getattr(llm.engine.tokenizer, "chat_template", None):
        raise UsageError("--chat: this model has no chat template; give one with "
                         "--chat-template FILE (a Jinja template), or drop --chat")
