"""``quire bench``: throughput, latency, images, serving load, option sweeps, KV memory.

Each benchmark is a subcommand (``quire bench throughput`` ...); see docs/bench.md. This
module only reads flags and puts the parts of :mod:`quire.bench` together; building the
parser imports nothing heavy (the engine, httpx, matplotlib are imported when a
benchmark runs).

Exit status: 0; 1 when a peer failed (the other results are still printed and saved);
2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from quire.bench.peers.spec import PEERS
from quire.bench.serve import SPLITS
from quire.bench.workloads import PRESETS, BenchRequest, WorkloadSpec, preset
from quire.entrypoints.cli.common import UsageError, open_registry
from quire.entrypoints.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
)
from quire.model_store import DEFAULT_MODEL

#: Kept in step with quire.bench.sweep.SWEEPABLE (a test checks it), so that building the
#: parser does not import the engine.
SWEEP_OPTIONS = ("block_size", "max_num_batched_tokens", "max_num_seqs")
_EXTRA_HINT = "pip install -e '.[bench]'"


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark throughput, latency, serving, options and KV memory",
        description="Benchmarks on fixed, seeded workloads (W1..W6); see docs/bench.md.")
    benches = parser.add_subparsers(title="benchmarks", dest="bench_command", required=True)
    _register_offline(benches, "throughput", "W1", run_throughput,
                      "offline throughput: every request at once, run to completion")
    _register_offline(benches, "latency", "W2", run_latency,
                      "one request at a time: time to first token, inter-token latency")
    _register_images(benches)
    _register_serve(benches)
    _register_abuse(benches)
    _register_sweep(benches)
    _register_host(benches)
    _register_memory(benches)
    _register_beam(benches)
    _register_accuracy(benches)
    _register_install_peer(benches)


# -- flags ---------------------------------------------------------------------------------
def _add_workload_options(parser: argparse.ArgumentParser, default: str,
                          timed: bool = True) -> None:
    group = parser.add_argument_group("workload")
    names = ", ".join(f"{w.name} ({w.description})" for w in PRESETS.values())
    group.add_argument("--workload", default=default, metavar="NAME",
                       help=f"a preset: {names} (default: {default})")
    group.add_argument("--num-requests", type=int, default=None, help="override: requests")
    group.add_argument("--input-len", type=int, default=None,
                       help="override: prompt tokens (after any shared prefix), fixed")
    group.add_argument("--output-len", type=int, default=None,
                       help="override: output tokens, fixed")
    group.add_argument("--output", metavar="PATH", default=None,
                       help="also write the results as JSON here")
    if not timed:
        return
    group.add_argument("--repeats", type=int, default=3,
                       help="runs to take the median of; each draws new text of the same "
                       "shape (default: 3)")
    group.add_argument("--warmup", type=int, default=0 if default == "W5" else 1,
                       help="untimed runs first, on text of their own (default: 1; serve: 0)")


def _register_offline(benches: argparse._SubParsersAction[Any], name: str, workload: str,
                      run: Any, help_text: str) -> None:
    parser = benches.add_parser(name, help=help_text, description=help_text)
    _add_workload_options(parser, workload)
    parser.add_argument("--peer", action="append", dest="peers", default=[],
                        choices=sorted(PEERS), help="also run the workload on this peer "
                        "(repeatable); see quire bench install-peer")
    parser.add_argument("--peer-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="give up on a peer after this long (default: 3600)")
    parser.add_argument("--vllm-dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="the dtype of the vllm peer, to measure it at its best on the "
                        "host (default: float32)")
    parser.add_argument("--llamacpp-kv-type", default="f16", choices=("f16", "f32"),
                        help="the llamacpp peer's KV cache type (default: f16, llama.cpp's "
                        "own)")
    parser.add_argument("--llamacpp-repack", default="on", choices=("on", "off"),
                        help="off: the llamacpp peer without its repacked weight layouts "
                        "(AMX and others; llama.cpp's use_extra_bufts), whose AMX path "
                        "crashes on some hosts (default: on, its own default)")
    parser.add_argument("--llamacpp-variant", default="both",
                        choices=("both", "native", "f32"),
                        help="which llamacpp runs: the GGUF file as it is (native), an F32 "
                        "copy of it (f32), or both (default: both)")
    if name == "throughput":
        parser.add_argument("--structured-json", default=None, metavar="SCHEMA",
                            help="put every request under this JSON schema (its text) "
                            "to measure the grammar mask's cost; it must not let the "
                            "output end before --output-len tokens")
        parser.add_argument("--lora-adapter", action="append", default=[], metavar="PATH",
                            help="a LoRA adapter (PEFT's format) the requests take in "
                            "turn with the others given (repeat the flag); needs "
                            "--enable-lora and --max-loras at least their number to mix "
                            "them all in one step")
    add_engine_options(parser)
    parser.set_defaults(run=run)


#: The peers the image workload runs on (they load the checkpoint directory as it is).
IMAGE_PEERS = ("hf", "vllm")


def _register_images(benches: argparse._SubParsersAction[Any]) -> None:
    help_text = ("image-text models: TTFT with a fresh and a repeated image, requests/s, "
                 "the encoder's share")
    parser = benches.add_parser(
        "images", help=help_text,
        description="One seeded random image and a question of --input-len tokens per "
        "request: TTFT of one request, TTFT of the same image and question again (the "
        "prefix cache), requests/s with --concurrency at once, and the encoder's share "
        "of the TTFT (see quire.bench.images).")
    group = parser.add_argument_group("workload")
    group.add_argument("--image-size", type=int, default=448, metavar="PIXELS",
                       help="side of each square random image (default: 448)")
    group.add_argument("--input-len", type=int, default=64,
                       help="text tokens of each question, around the image's placeholder "
                       "(default: 64)")
    group.add_argument("--output-len", type=int, default=64,
                       help="output tokens of each concurrent request (default: 64)")
    group.add_argument("--concurrency", type=int, default=16,
                       help="requests at once for requests/s (default: 16)")
    group.add_argument("--repeats", type=int, default=3,
                       help="passes to take the median of, each with new images and text "
                       "(default: 3; one untimed pass runs first)")
    group.add_argument("--output", metavar="PATH", default=None,
                       help="also write the results as JSON here")
    parser.add_argument("--peer", action="append", dest="peers", default=[],
                        choices=IMAGE_PEERS, help="also run the workload on this peer "
                        "(repeatable); see quire bench install-peer")
    parser.add_argument("--peer-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="give up on a peer after this long (default: 3600)")
    add_engine_options(parser)
    parser.set_defaults(run=run_images)


def _register_serve(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "serve", help="load a running OpenAI-compatible server",
        description="Stream /v1/completions from a running server (ours or any other) at "
        "--url, from --concurrency clients or at a Poisson --request-rate.")
    _add_workload_options(parser, "W5")
    parser.add_argument("--url", required=True, action="append",
                        help="the server, e.g. http://127.0.0.1:8000; repeat it to spread "
                        "the requests over several (with one --served-model-name each)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None, metavar="N[,N...]",
                      help="clients sending one request after another (default: the "
                      "workload's, W5: 120); several increasing levels (1,2,4,8) run "
                      "one after another and report the highest whose p95 meets "
                      "--slo-ttft/--slo-e2e")
    load.add_argument("--request-rate", type=float, default=None, metavar="PER_S",
                      help="Poisson arrivals per second instead of fixed clients")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                        help="goodput counts requests whose TTFT is at most this")
    parser.add_argument("--slo-e2e", type=float, default=None, metavar="SECONDS",
                        help="goodput counts requests whose end-to-end latency is at most this")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model whose tokenizer sizes the prompts (a path or a "
                        f"built-in name; default: {DEFAULT_MODEL})")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory instead")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="the 'model' field sent (default: the first of /v1/models); "
                        "repeat it to spread the requests over several models")
    parser.add_argument("--split", choices=SPLITS, default="alternate",
                        help="with several targets: request i to target i mod n "
                        "(alternate), or the first half to the first and the rest to the "
                        "second, traffic that shifts (halves) (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="per-request HTTP timeout (default: 600)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--transport", choices=("http", "grpc"), default="http",
                        help="stream /v1/completions (http), or quire serve's gRPC Generate "
                        "at --grpc-url (grpc; --url is still read for /metrics) "
                        "(default: %(default)s)")
    parser.add_argument("--grpc-url", default=None, metavar="HOST:PORT",
                        help="quire serve's --grpc-port, for --transport grpc")
    parser.set_defaults(run=run_serve)


def serve_targets(urls: list[str], names: list[str] | None) -> list[tuple[str, str | None]]:
    """(url, model) of each target: every name at one url, or a url per name.

    :raises UsageError: several urls with another number of names."""
    if len(urls) == 1:
        return [(urls[0], name) for name in names] if names else [(urls[0], None)]
    if names and len(names) != len(urls):
        raise UsageError(f"--served-model-name: {len(names)} names for {len(urls)} --url "
                         "(one per --url)")
    return list(zip(urls, names or [None] * len(urls)))


def _register_abuse(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "abuse", help="normal streaming clients alone, then beside abusive ones",
        description="Run --clients streaming clients against a server twice: alone, then "
        "beside clients that never read, send headers a byte a second, or send requests "
        "at the limits; report their latency in both and the ratio (see quire.bench.abuse).")
    target = parser.add_argument_group("server")
    target.add_argument("--url", default=None,
                        help="a running server; without it, quire serve is started on --model")
    target.add_argument("--server-pid", type=int, default=None,
                        help="the --url server's process id, to read its resident memory")
    target.add_argument("--serve-args", default="", metavar="ARGS",
                        help="more flags for the quire serve started here, as one string: "
                        "--serve-args='--device cpu --max-num-seqs 64'")
    target.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"the model served, whose tokenizer sizes the prompts "
                        f"(default: {DEFAULT_MODEL})")
    target.add_argument("--tokenizer", default=None, help="a tokenizer directory instead")
    target.add_argument("--served-model-name", default=None,
                        help="the 'model' field sent (default: the first of /v1/models)")
    target.add_argument("--api-key", default=None, help="sent as a bearer token")
    target.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="per-request HTTP timeout (default: 600)")
    load = parser.add_argument_group("normal clients")
    load.add_argument("--clients", type=int, default=100,
                      help="normal streaming clients, one request each (default: 100)")
    load.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: 64)")
    load.add_argument("--output-len", type=int, default=32, help="output tokens (default: 32)")
    load.add_argument("--warmup", type=int, default=1,
                      help="untimed passes of the normal clients first (default: 1)")
    abuse = parser.add_argument_group("abusive clients")
    for flag, default, text in (
            ("--non-readers", 4, "streams of the most sequences that are never read"),
            ("--slow-headers", 8, "connections sending headers a byte at a time"),
            ("--max-stop-clients", 2, "clients sending the most and longest stop strings"),
            ("--max-fanout-clients", 2, "clients sending the most sequences (prompts x n)")):
        abuse.add_argument(flag, type=int, default=default, help=f"{text} (default: {default})")
    abuse.add_argument("--slow-interval", type=float, default=1.0, metavar="SECONDS",
                       help="between two header bytes (default: 1)")
    parser.add_argument("--output", metavar="PATH", default=None,
                        help="also write the results as JSON here")
    parser.set_defaults(run=run_abuse)


def _register_sweep(benches: argparse._SubParsersAction[Any]) -> None:
    # "resolve": the swept options replace the engine flags of the same name
    parser = benches.add_parser(
        "sweep", conflict_handler="resolve",
        help="throughput over several values of one engine option",
        description="Run one throughput workload once per value of one option and write a "
        "table, and a PNG plot with --plot.")
    _add_workload_options(parser, "W1")
    add_engine_options(parser)
    for option in SWEEP_OPTIONS:
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, default=None, metavar="N[,N...]",
                            help="one value, or several to sweep (comma-separated)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a PNG of throughput and KV memory per value")
    parser.set_defaults(run=run_sweep)


def _register_host(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "host", help="the host's share of a decode step (the forward left out)",
        description="Time decode steps at each batch size whole, then with the model's "
        "forward replaced by ready logits, and split the host's part into scheduling, "
        "inputs, sampling and output processing (see quire.bench.host_overhead).")
    parser.add_argument("--batch-sizes", default="1,64,256", metavar="N[,N...]",
                        help="decoding sequences per step (default: 1,64,256)")
    parser.add_argument("--steps", type=int, default=20,
                        help="decode steps timed each way (default: 20)")
    parser.add_argument("--output", metavar="PATH", default=None,
                        help="also write the results as JSON here")
    add_engine_options(parser)
    parser.set_defaults(run=run_host)


def run_host(args: argparse.Namespace) -> int:
    import dataclasses

    from quire.bench.host_overhead import PARTS, measure
    from quire.bench.quire_engine import build_engine, describe
    from quire.bench.report import record

    try:
        sizes = [int(n) for n in args.batch_sizes.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise UsageError("--batch-sizes: give positive integers, comma-separated") from None
    if args.steps < 1:
        raise UsageError("--steps: must be >= 1")
    config = engine_config_from_args(args)
    if config.world_size > 1 or config.data_parallel_size > 1:
        raise UsageError("quire bench host: the model must run in this process "
                         "(world size 1, one replica)")
    if max(sizes) > (config.max_num_seqs or 256):
        raise UsageError(f"--batch-sizes: {max(sizes)} is more than --max-num-seqs")
    try:
        engine = build_engine(config, open_registry(args))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    results = [measure(engine, n, args.steps).figures() for n in sizes]
    header = ["batch", "step ms", "host ms", "host less device ms", "host share",
              *(f"{p} ms" for p in PARTS)]
    rows = [[f"{r['batch']:.0f}", f"{r['step_ms']:.3f}", f"{r['host_step_ms']:.3f}",
             f"{r['host_less_device_ms']:.3f}", f"{r['host_share']:.0%}",
             *(f"{r[p + '_ms']:.3f}" for p in PARTS)]
            for r in results]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    table = "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths))
                      for row in [header, *rows])
    payload = record("host", {"engine": dataclasses.asdict(config), "steps": args.steps},
                     results=results, engine_description=describe(engine))
    _finish(args, f"quire bench host: median of {args.steps} decode steps, "
            f"{describe(engine)}", table, [], payload)
    return 0


def _register_memory(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "memory", help="paged vs contiguous KV allocation, simulated (no model run)",
        description="How many sequences of a workload run at once in a fixed KV budget, "
        "and how much of it is wasted, with paged KV (our BlockManager) and with "
        "contiguous reservations.")
    _add_workload_options(parser, "W3", timed=False)
    parser.add_argument("--kv-memory", default="8192tok", metavar="BUDGET",
                        help="tokens (8192tok) or bytes (2GiB, 500MB; needs the model's "
                        "size per token, from --model) (default: 8192tok)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="what a contiguous max-length reservation holds")
    parser.add_argument("--enable-prefix-caching", default="true", choices=["true", "false"],
                        help="paged: share full prompt pages (default: true)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="only for a budget in bytes: the model whose KV size per "
                        "token converts it")
    parser.add_argument("--dtype", default="float32",
                        help="KV dtype, for a budget in bytes: float32, bfloat16, float16, "
                        "or int8 / fp8 (kv_cache_dtype: 1 byte an element plus a 4-byte "
                        "scale per head row)")
    parser.set_defaults(run=run_memory)


def _register_beam(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "beam", help="beam search against as many samples: peak KV pages, wall time",
        description="One prompt, beam search with --beam-width beams against n=width "
        "seeded samples (temperature 1), both --max-tokens past EOS: the most KV pages "
        "held at once and the wall time (see quire.bench.beam).")
    parser.add_argument("--prompt", default="The capital of France is",
                        help="the prompt text")
    parser.add_argument("--beam-width", type=int, default=4, help="beams, and samples")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens")
    parser.add_argument("--sample-seed", type=int, default=0, help="the samples' seed")
    parser.add_argument("--output", metavar="PATH", default=None,
                        help="also write the results as JSON here")
    add_engine_options(parser)
    parser.set_defaults(run=run_beam)


def run_beam(args: argparse.Namespace) -> int:
    from quire.bench.beam import BEAM_FIGURES, compare
    from quire.bench.report import figure_rows, record
    from quire.engine import LLMEngine
    from quire.entrypoints.llm import LLM

    if args.beam_width < 1 or args.max_tokens < 1:
        raise UsageError("--beam-width and --max-tokens must be >= 1")
    config = engine_config_from_args(args)
    figures = compare(lambda: LLM.from_engine(LLMEngine(config)), args.prompt,
                      args.beam_width, args.max_tokens, args.sample_seed)
    settings = {"model": config.model, "prompt": args.prompt,
                "beam_width": args.beam_width, "max_tokens": args.max_tokens,
                "sample_seed": args.sample_seed}
    _finish(args, f"quire bench beam: {args.beam_width} beams vs {args.beam_width} "
            f"samples, {args.max_tokens} tokens, {config.model}",
            figure_rows(BEAM_FIGURES, figures, "mode"), [],
            record("beam", settings, modes=figures))
    return 0


#: The reference's own flags, and the engine option each sets.
_REF_FLAGS = {"--ref-dtype": "dtype", "--ref-quantization": "quantization",
              "--ref-kv-cache-dtype": "kv_cache_dtype"}


def _register_accuracy(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "accuracy", help="next-token distributions against a reference: KL, top-1, perplexity",
        description="Run a fixed text through the tested configuration (the engine flags) "
        "and a reference (by default the same options at dtype=float32, quantization=none, "
        "kv_cache_dtype=auto) and compare every position's full next-token distribution: "
        "KL(ref || test), top-1 agreement, perplexity (see quire.bench.accuracy). With the "
        "llamacpp peer installed and a GGUF model, llama.cpp's run of the same file is "
        "scored against the same reference.")
    text = parser.add_argument_group("text")
    text.add_argument("--text", metavar="FILE", default=None,
                      help="a UTF-8 text file instead of the shipped one (Alice's Adventures "
                      "in Wonderland, chapter I: about 2,000 tokens)")
    text.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help="use at most the first N tokens of the text (default: all of it, "
                      "up to the context)")
    ref = parser.add_argument_group("reference")
    for flag, option in _REF_FLAGS.items():
        ref.add_argument(flag, default=None, metavar=option.upper(),
                         help=f"the reference's {option} (default: "
                         f"{_ref_default(option)})")
    ref.add_argument("--ref-option", action="append", default=[], metavar="KEY=VALUE",
                     help="any other engine option of the reference (repeatable): "
                     "--ref-option device=cpu; the reference otherwise takes the tested "
                     "options")
    peer = parser.add_argument_group("llama.cpp peer")
    peer.add_argument("--no-llamacpp", action="store_true",
                      help="do not run the llamacpp peer even when it is installed")
    peer.add_argument("--llamacpp-kv-type", default="f16", choices=("f16", "f32"),
                      help="llama.cpp's KV cache type (default: f16, its own default)")
    peer.add_argument("--peer-timeout", type=float, default=3600.0, metavar="SECONDS",
                      help="give up on the peer after this long (default: 3600)")
    parser.add_argument("--json", "--output", dest="output", metavar="FILE", default=None,
                        help="also write every figure and both configurations as JSON")
    add_engine_options(parser)
    parser.set_defaults(run=run_accuracy)


def _ref_default(option: str) -> str:
    from quire.bench.accuracy import REFERENCE_DEFAULTS

    return f"{REFERENCE_DEFAULTS[option]}"


def _accuracy_options(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tested options (the engine flags that differ from their defaults) and the
    reference's overrides. :raises UsageError: naming the flag."""
    import dataclasses

    from quire.config import EngineConfig

    config = engine_config_from_args(args)
    test = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name != "model" and getattr(config, f.name) != f.default}
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    overrides: dict[str, Any] = {}
    for flag, option in _REF_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if option not in known:
            raise UsageError(f"{flag}: this build has no {option} option")
        overrides[option] = value
    for item in args.ref_option:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"--ref-option: expected KEY=VALUE, got {item!r}")
        if key not in known or key == "model":
            raise UsageError(f"--ref-option: unknown engine option {key!r}; known: "
                             f"{', '.join(sorted(known - {'model'}))}")
        overrides[key] = _engine_value(key, value.strip())
    return test, overrides


class _ValueParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ValueError(message)


def _engine_value(key: str, text: str) -> Any:
    """``text`` as engine option ``key``'s flag converts it."""
    parser = _ValueParser(add_help=False)
    add_engine_options(parser)
    flag = "--" + key.replace("_", "-")
    try:
        return getattr(parser.parse_args([flag, text]), key)
    except ValueError as exc:
        raise UsageError(f"--ref-option {key}: {exc}") from None


def run_accuracy(args: argparse.Namespace) -> int:
    from quire.bench import accuracy
    from quire.bench.peers.runner import PeerError, check_installed
    from quire.bench.peers.spec import PEERS
    from quire.bench.report import record
    from quire.config import EngineConfig
    from quire.model_store import model_path_of
    from quire.tokenizer import load_tokenizer

    if args.max_tokens is not None and args.max_tokens < 2:
        raise UsageError("--max-tokens: must be >= 2 (one position predicting the next)")
    test, overrides = _accuracy_options(args)
    ref = accuracy.reference_options(test, overrides)
    try:
        EngineConfig.from_kwargs(args.model, **ref)
    except ValueError as exc:
        named = [f for f, o in _REF_FLAGS.items() if o in str(exc) and o in overrides]
        raise UsageError(f"{named[0] if named else '--ref-option'}: {exc}") from exc
    try:
        text = accuracy.load_text(args.text)
    except ValueError as exc:
        raise UsageError(f"--text: {exc}") from exc
    config = engine_config_from_args(args)
    try:
        tokenizer = load_tokenizer(config.tokenizer or model_path_of(config))
        context = accuracy.context_of(config)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from exc
    try:
        ids = accuracy.text_token_ids(tokenizer, text, args.max_tokens, context)
    except ValueError as exc:
        raise UsageError(f"--text: {exc}") from exc
    gguf = model_path_of(config)
    peer_note, run_peer = None, False
    if args.no_llamacpp:
        peer_note = "llama.cpp peer: not run (--no-llamacpp)"
    elif not gguf.endswith(".gguf"):
        peer_note = "llama.cpp peer: not run (the model is not a GGUF file)"
    else:
        try:
            check_installed(PEERS["llamacpp"])
            run_peer = True
        except PeerError:
            peer_note = ("llama.cpp peer: not installed (quire bench install-peer "
                         "llamacpp); skipped")
    registry = open_registry(args)
    columns: dict[str, Any] = {}
    failures: dict[str, str] = {}
    try:
        with accuracy.Comparison(args.model, ids, ref, registry) as comparison:
            columns["quire"] = comparison.score(test)
            if run_peer:
                print("quire bench: running llama.cpp on the same token ids ...",
                      file=sys.stderr)
                try:
                    columns["llamacpp"] = accuracy.score_llamacpp(
                        comparison, gguf, kv_type=args.llamacpp_kv_type,
                        timeout_s=args.peer_timeout)
                except (PeerError, RuntimeError) as exc:
                    print(f"quire bench: peer llamacpp failed: {exc}", file=sys.stderr)
                    failures["llamacpp"] = str(exc)
    except (ValueError, RuntimeError) as exc:
        from quire.entrypoints.cli.engine_options import engine_error

        raise engine_error(exc) from exc
    source = args.text or "the shipped text (Alice's Adventures in Wonderland, ch. I)"
    quire = columns["quire"]
    title = (f"quire bench accuracy: {quire.num_positions} positions of {source} "
             f"({quire.num_tokens} tokens), model {args.model}")
    notes = [f"tested: {_describe_run(quire.test)}",
             f"reference: {_describe_run(quire.reference)}"]
    if "llamacpp" in columns:
        notes.append(f"llamacpp: {columns['llamacpp'].test['description']} on {gguf}, "
                     "against the same reference")
    if peer_note:
        notes.append(peer_note)
    notes += [f"llamacpp: FAILED: {error}" for error in failures.values()]
    settings = {"model": args.model, "text": args.text or str(accuracy.DEFAULT_TEXT),
                "max_tokens": args.max_tokens, "num_tokens": len(ids),
                "tested_options": accuracy.plain(test),
                "reference_options": accuracy.plain(ref)}
    payload = record("accuracy", settings,
                     results={name: {"figures": r.figures(), "tested": r.test,
                                     "reference": r.reference}
                              for name, r in columns.items()},
                     peer_errors=failures)
    _finish(args, title, accuracy.table(columns), notes, payload)
    return 1 if failures else 0


def _describe_run(info: dict[str, Any]) -> str:
    extra = ", ".join(f"{k}={info[k]}" for k in ("quantization", "kv_cache_dtype")
                      if info.get(k) is not None)
    return f"{info['description']}{', ' + extra if extra else ''}"


def _register_install_peer(benches: argparse._SubParsersAction[Any]) -> None:
    parser = benches.add_parser(
        "install-peer", help="install a peer engine into its own virtual environment",
        description="Create <cache>/peers/NAME and pip-install the peer there (see "
        "docs/bench.md); never into quire's environment.")
    parser.add_argument("name", choices=sorted(PEERS))
    parser.add_argument("--force", action="store_true",
                        help="run the install steps even if the peer already imports")
    parser.set_defaults(run=run_install_peer)


# -- shared steps --------------------------------------------------------------------------
def _workload(args: argparse.Namespace) -> WorkloadSpec:
    if getattr(args, "repeats", 1) < 1:
        raise UsageError("--repeats: must be >= 1")
    if getattr(args, "warmup", 0) < 0:
        raise UsageError("--warmup: must be >= 0")
    try:
        return preset(args.workload).with_overrides(args.num_requests, args.input_len,
                                                    args.output_len)
    except ValueError as exc:
        raise UsageError(f"--workload: {exc}") from exc


def require(module: str, purpose: str) -> Any:
    """Import an optional dependency. :raises UsageError: naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{purpose} needs {module}, which is not installed: "
                         f"{_EXTRA_HINT}") from None


def _finish(args: argparse.Namespace, title: str, table: str, notes: list[str],
            payload: dict[str, Any]) -> None:
    from quire.bench.report import write_json

    print(title)
    print(table)
    for note in notes:
        print(note)
    if args.output:
        write_json(args.output, payload)
        print(f"results written to {args.output}", file=sys.stderr)


def _requests(spec: WorkloadSpec, tokenizer: Any, name: str,
              args: argparse.Namespace) -> list[Any]:
    """The passes to run: ``--warmup`` untimed ones (drawn apart, repeat -1, -2, ...),
    then ``--repeats`` timed ones; drop the first ``args.warmup`` results."""
    from quire.bench.corpus import Corpus, TokenizerSource
    from quire.bench.workloads import build_requests

    corpus = Corpus(TokenizerSource(tokenizer, name))
    indices = [-1 - w for w in range(args.warmup)] + list(range(args.repeats))
    try:
        return [build_requests(spec, corpus, r) for r in indices]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _settings(spec: WorkloadSpec, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What a JSON record says about how it was run."""
    import dataclasses

    return {"workload": dataclasses.asdict(spec), "repeats": args.repeats,
            "warmup": args.warmup, **extra}


def _check_fits(spec: WorkloadSpec, max_model_len: int) -> None:
    if spec.max_total_len > max_model_len:
        raise UsageError(f"workload {spec.name} reaches {spec.max_total_len} tokens per "
                         f"sequence, more than max_model_len={max_model_len}; use "
                         "--input-len/--output-len or a model with a longer context")


# -- throughput and latency ----------------------------------------------------------------
def run_throughput(args: argparse.Namespace) -> int:
    import functools

    from quire.bench import throughput
    from quire.bench.report import THROUGHPUT_FIGURES
    from quire.lora.request import LoRARequest
    from quire.structured.params import StructuredOutputsParams

    structured = None
    if args.structured_json is not None:
        try:
            structured = StructuredOutputsParams(json=args.structured_json)
        except ValueError as exc:
            raise UsageError(f"--structured-json: {exc}") from exc
        if args.peers:
            raise UsageError("--structured-json: the peers run without it; drop --peer")
    loras = [LoRARequest(f"adapter{i}", i + 1, path)
             for i, path in enumerate(args.lora_adapter)]
    if loras and args.peers:
        raise UsageError("--lora-adapter: the peers run without adapters; drop --peer")
    run = functools.partial(throughput.run_quire, structured=structured, loras=loras)
    return _run_offline(args, "throughput", run, THROUGHPUT_FIGURES)


def run_latency(args: argparse.Namespace) -> int:
    from quire.bench import latency
    from quire.bench.report import LATENCY_FIGURES

    return _run_offline(args, "latency", latency.run_quire, LATENCY_FIGURES)


def _run_offline(args: argparse.Namespace, mode: str, run_quire: Any, figures: Any) -> int:
    import dataclasses
    import gc

    from quire.bench.quire_engine import build_engine, describe, spec_decode_figures
    from quire.bench.report import Column, comparison_table, record
    from quire.model_store import model_path_of

    spec = _workload(args)
    config = engine_config_from_args(args)
    _check_peers(args.peers)
    try:
        engine = build_engine(config, open_registry(args))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    _check_fits(spec, engine.config.max_model_len)
    runs = _requests(spec, engine.tokenizer, config.model, args)

    def measured(requests: Any) -> dict[str, float]:
        before = engine.stats()
        figures = run_quire(engine, requests).figures()
        return {**figures, **spec_decode_figures(before, engine.stats())}

    figures_per_run = [measured(requests) for requests in runs]
    columns = [Column("quire", describe(engine), figures_per_run[args.warmup:])]
    # the hf peer runs where Quire ran, at its dtype (the CPU builds of vLLM and llama.cpp
    # cannot follow)
    where = {"device": engine.info.device_type,
             "dtype": str(engine.config.dtype).removeprefix("torch.")}
    del engine  # free its memory before any peer runs
    gc.collect()
    peer_columns, failures = _run_peers(args, mode, model_path_of(config), runs, where)
    columns += peer_columns
    title = (f"quire bench {mode}: {spec.name} ({spec.description}), median of "
             f"{args.repeats}, model {config.model}")
    notes = [f"{c.name}: {c.description}" for c in columns] + \
        [f"{name}: FAILED: {error}" for name, error in failures.items()]
    settings = _settings(spec, args, engine=dataclasses.asdict(config), peers=args.peers)
    payload = record(mode, settings, columns, peer_errors=failures)
    _finish(args, title, comparison_table(figures, columns), notes, payload)
    return 1 if failures else 0


def _check_peers(names: list[str]) -> None:
    """Fail before the long part when a peer asked for is not installed."""
    from quire.bench.peers.runner import PeerError, check_installed

    needed = set(names) | ({"hf"} if "vllm" in names else set())  # hf converts for vllm
    for name in sorted(needed):
        try:
            check_installed(PEERS[name])
        except PeerError as exc:
            raise UsageError(f"--peer {name}: {exc}") from exc


def _run_peers(args: argparse.Namespace, mode: str, model_path: str,
               runs: list[Any], where: dict[str, str] | None = None
               ) -> tuple[list[Any], dict[str, str]]:
    """Each peer's columns; a peer that fails is reported, not fatal.

    ``where``: the device type and dtype Quire ran at, for the peers that can follow.
    """
    from quire.bench.peers.models import model_variants
    from quire.bench.peers.runner import PeerError, measure
    from quire.bench.report import Column

    columns, failures = [], {}
    options = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
               "vllm_dtype": getattr(args, "vllm_dtype", "float32"),
               "kv_type": getattr(args, "llamacpp_kv_type", "f16"),
               "repack": getattr(args, "llamacpp_repack", "on") == "on", **(where or {})}
    for name in dict.fromkeys(args.peers):
        spec = PEERS[name]
        try:
            variant = getattr(args, "llamacpp_variant", "both")
            for column, path in model_variants(spec, model_path, variant):
                print(f"quire bench: running {column} on {path} ...", file=sys.stderr)
                result = measure(spec, mode, column, path, runs, options, args.peer_timeout)
                timed = result.runs[args.warmup:]
                columns.append(Column(column, f"{result.description} (loaded in "
                                      f"{result.load_s:.1f}s)",
                                      [run.figures() for run in timed]))
        except PeerError as exc:
            print(f"quire bench: peer {name} failed: {exc}", file=sys.stderr)
            failures[name] = str(exc)
    return columns, failures


# -- images --------------------------------------------------------------------------------
def run_images(args: argparse.Namespace) -> int:
    import dataclasses
    import gc

    from quire.bench import images as bench
    from quire.bench.peers.runner import PeerError, check_installed
    from quire.bench.quire_engine import build_engine, describe
    from quire.bench.report import Column, comparison_table, record
    from quire.entrypoints.llm import LLM
    from quire.model_store import model_path_of

    try:
        spec = bench.ImageWorkload(args.image_size, args.input_len, args.output_len,
                                   args.concurrency, args.repeats)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    config = engine_config_from_args(args)
    for name in dict.fromkeys(args.peers):
        try:
            check_installed(PEERS[name])
        except PeerError as exc:
            raise UsageError(f"--peer {name}: {exc}") from exc
    try:
        engine = build_engine(config, open_registry(args))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    try:
        inputs = engine.image_inputs()
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from exc
    try:
        questions = bench.Questions(engine.tokenizer, inputs.placeholder, spec.input_len,
                                    spec.seed)
        warmup, passes = bench.build_passes(spec, questions)
        images = {r.image_seed: bench.random_image(spec.image_size, r.image_seed)
                  for p in [warmup, *passes] for r in [p.single, *p.batch]}
        prompt_len = bench.check_length(inputs, warmup.single.prompt,
                                        images[warmup.single.image_seed], spec.input_len)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if prompt_len + spec.output_len > engine.config.max_model_len:
        raise UsageError(f"--output-len: {prompt_len} prompt tokens and {spec.output_len} "
                         f"more exceed max_model_len={engine.config.max_model_len}")
    llm = LLM.from_engine(engine)
    timer = bench.encoder_timer(engine)
    bench.run_quire(llm, warmup, images, timer)
    runs = [bench.run_quire(llm, p, images, timer) for p in passes]
    columns = [Column("quire", describe(engine), [r.figures() for r in runs])]
    notes = [] if timer else ["quire: the model runs in worker processes; encoder not timed"]
    del llm, engine, timer  # free its memory before any peer runs
    gc.collect()
    peer_columns, failures = _run_image_peers(args, spec, model_path_of(config), warmup,
                                              passes, images)
    columns += peer_columns
    title = (f"quire bench images: one {spec.image_size}x{spec.image_size} image + "
             f"{spec.input_len}-token question ({prompt_len} prompt tokens); "
             f"{spec.concurrency} concurrent x {spec.output_len} tokens; median of "
             f"{spec.repeats}, model {config.model}")
    notes = [f"{c.name}: {c.description}" for c in columns] + notes + \
        [f"{name}: FAILED: {error}" for name, error in failures.items()]
    settings = bench.settings(spec, engine=dataclasses.asdict(config), peers=args.peers)
    payload = record("images", settings, columns, peer_errors=failures)
    _finish(args, title, comparison_table(bench.IMAGE_FIGURES, columns), notes, payload)
    return 1 if failures else 0


def _run_image_peers(args: argparse.Namespace, spec: Any, model_path: str, warmup: Any,
                     passes: list[Any], images: dict[Any, Any]
                     ) -> tuple[list[Any], dict[str, str]]:
    """Each image peer's column; a peer that fails is reported, not fatal. The images
    go to the worker as PNG files in a temporary directory."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from quire.bench import images as bench
    from quire.bench.peers.runner import PeerError, run_worker
    from quire.bench.report import Column

    columns, failures = [], {}
    if not args.peers:
        return columns, failures
    with tempfile.TemporaryDirectory(prefix="quire-bench-images-") as tmp:
        png = bench.write_pngs(images, Path(tmp))
        for name in dict.fromkeys(args.peers):
            peer = dataclasses.replace(PEERS[name], worker=bench.WORKER)
            options = {"engine": name, "max_model_len": args.max_model_len,
                       "max_num_seqs": args.max_num_seqs}
            job = bench.peer_job(model_path, warmup, passes, png, options)
            print(f"quire bench: running {name} on the images ...", file=sys.stderr)
            try:
                result = run_worker(peer, job, args.peer_timeout)
                runs = bench.peer_runs(result, spec)
            except (PeerError, ValueError) as exc:
                print(f"quire bench: peer {name} failed: {exc}", file=sys.stderr)
                failures[name] = str(exc)
                continue
            columns.append(Column(name, f"{result['engine']} (loaded in "
                                  f"{float(result.get('load_s', 0.0)):.1f}s)",
                                  [r.figures() for r in runs]))
    return columns, failures


# -- serve ---------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from quire.bench import serve
    from quire.bench.report import SERVE_FIGURES, Column, comparison_table, record
    from quire.bench.stats import SLO

    require("httpx", "quire bench serve")
    spec = _workload(args)
    try:
        slo = SLO(args.slo_ttft, args.slo_e2e)
        levels = _concurrency_levels(args, spec, slo)
        if len(levels) > 1:
            return _run_serve_levels(args, spec, slo, levels)
        concurrency = None if args.request_rate else \
            (levels or [spec.concurrency or spec.num_requests])[0]
        shape = serve.LoadShape(concurrency, args.request_rate, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    runs, targets, urls = _serve_inputs(args, spec)
    try:
        model, results = serve.run(targets, runs, shape, None, args.api_key, args.timeout,
                                   args.split, _grpc_address(args))
    except (RuntimeError, OSError) as exc:
        raise UsageError(f"--url {urls}: {exc}") from exc
    column = Column("server", f"{urls}, model {model!r}",
                    [run.figures(slo) for run in results[args.warmup:]])
    load = f"{shape.concurrency} clients" if shape.concurrency else \
        f"Poisson {shape.request_rate}/s"
    spread = f", {args.split} over {len(targets)} targets" if len(targets) > 1 else ""
    over = f", gRPC at {args.grpc_url}" if args.transport == "grpc" else ""
    title = (f"quire bench serve: {spec.name} ({spec.description}), {load}{spread}, "
             f"median of {args.repeats}, {urls}{over}")
    settings = _settings(spec, args, url=urls, model=model, split=args.split,
                         load=dataclasses.asdict(shape), slo=dataclasses.asdict(slo),
                         transport=args.transport, grpc_url=args.grpc_url)
    payload = record("serve", settings, [column])
    _finish(args, title, comparison_table(SERVE_FIGURES, [column]), [], payload)
    return 0


def _serve_inputs(args: argparse.Namespace, spec: WorkloadSpec
                  ) -> tuple[list[list[BenchRequest]], list[tuple[str, str | None]], str]:
    """What every ``bench serve`` pass sends: each pass's requests (made with the
    model's tokenizer), the targets, and the URLs as one string for messages.

    :raises UsageError: for a model or tokenizer that does not load."""
    from quire.model_store import resolve_model
    from quire.tokenizer import load_tokenizer

    try:
        tokenizer_path = args.tokenizer or resolve_model(args.model)
        tokenizer = load_tokenizer(tokenizer_path)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    runs = _requests(spec, tokenizer, tokenizer_path, args)
    return runs, serve_targets(args.url, args.served_model_name), \
        ", ".join(dict.fromkeys(args.url))


def _grpc_address(args: argparse.Namespace) -> str | None:
    """``--grpc-url`` when ``--transport grpc``. :raises UsageError: when one lacks the
    other."""
    if args.transport == "http":
        if args.grpc_url is not None:
            raise UsageError("--grpc-url: needs --transport grpc")
        return None
    if not args.grpc_url or ":" not in args.grpc_url or "/" in args.grpc_url:
        raise UsageError(f"--grpc-url: --transport grpc needs the gRPC server as HOST:PORT, "
                         f"got {args.grpc_url!r}")
    return str(args.grpc_url)


def _concurrency_levels(args: argparse.Namespace, spec: WorkloadSpec, slo: Any) -> list[int]:
    """``--concurrency`` as levels ([] when not given).

    :raises UsageError: naming ``--concurrency`` for a bad list, several levels without
        an SLO, or a level above the requests a pass sends."""
    from quire.bench.slo import parse_levels

    if args.concurrency is None:
        return []
    try:
        levels = parse_levels(args.concurrency)
    except ValueError as exc:
        raise UsageError(f"--concurrency: {exc}") from exc
    if len(levels) > 1 and not slo.is_set:
        raise UsageError("--concurrency: several levels look for the highest that meets "
                         "an SLO: give --slo-ttft and/or --slo-e2e")
    if len(levels) > 1 and levels[-1] > spec.num_requests:
        raise UsageError(f"--concurrency: level {levels[-1]} exceeds the "
                         f"{spec.num_requests} requests of a pass (--num-requests)")
    return levels


def _run_serve_levels(args: argparse.Namespace, spec: WorkloadSpec, slo: Any,
                      levels: list[int]) -> int:
    """``bench serve`` at each concurrency level in turn (the same prompts at each),
    up to the first that misses ``slo``; the capacity line (:mod:`quire.bench.slo`)."""
    import dataclasses

    from quire.bench import serve
    from quire.bench.report import record
    from quire.bench.slo import capacity, describe, report, step_levels
    from quire.bench.stats import median_figures

    runs, targets, urls = _serve_inputs(args, spec)
    names: list[str] = []

    def measure(concurrency: int) -> dict[str, float]:
        shape = serve.LoadShape(concurrency, None, args.seed)
        try:
            model, results = serve.run(targets, runs, shape, None, args.api_key,
                                       args.timeout, args.split, _grpc_address(args))
        except (RuntimeError, OSError) as exc:
            raise UsageError(f"--url {urls}: {exc}") from exc
        names.append(model)
        return median_figures([r.figures(slo) for r in results[args.warmup:]])

    judged = step_levels(levels, measure, slo)
    title = (f"quire bench serve: {spec.name} ({spec.description}), concurrency "
             f"{args.concurrency} against {describe(slo)}, median of {args.repeats}, "
             f"{urls}, model {names[0]!r}")
    settings = _settings(spec, args, url=urls, model=names[0], split=args.split,
                         levels=levels, slo=dataclasses.asdict(slo),
                         transport=args.transport, grpc_url=args.grpc_url)
    payload = record("serve", settings, capacity=capacity(judged), levels=[
        {"concurrency": lv.concurrency, "met": lv.met, "misses": list(lv.misses),
         "median": dict(lv.figures)} for lv in judged])
    _finish(args, title, report(judged, slo), [], payload)
    return 0


# -- abuse ---------------------------------------------------------------------------------
def run_abuse(args: argparse.Namespace) -> int:
    import contextlib
    import dataclasses
    import shlex

    from quire.bench import abuse
    from quire.bench.corpus import Corpus, TokenizerSource
    from quire.bench.report import Column, comparison_table, record
    from quire.bench.workloads import WorkloadSpec, build_requests
    from quire.model_store import resolve_model
    from quire.tokenizer import load_tokenizer

    require("httpx", "quire bench abuse")
    if args.warmup < 0:
        raise UsageError("--warmup: must be >= 0")
    try:
        mix = abuse.AbuseMix(non_readers=args.non_readers, slow_headers=args.slow_headers,
                             max_stop_clients=args.max_stop_clients,
                             max_fanout_clients=args.max_fanout_clients,
                             slow_interval_s=args.slow_interval)
        spec = WorkloadSpec("abuse", "normal clients", num_requests=args.clients,
                            input_len=(args.input_len,) * 2, output_len=(args.output_len,) * 2,
                            concurrency=args.clients, seed=7)
        model_path = resolve_model(args.model)
        tokenizer = load_tokenizer(args.tokenizer or model_path)
        corpus = Corpus(TokenizerSource(tokenizer, args.tokenizer or model_path))
        # warm-ups draw -1, -2, ...; alone and abused each their own text (no prefix hits)
        passes = [build_requests(spec, corpus, r)
                  for r in [-1 - w for w in range(args.warmup)] + [0, 1]]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    with contextlib.ExitStack() as stack:
        url, pid = args.url, args.server_pid
        if url is None:
            served = abuse.ServeChild(["--model", model_path, *shlex.split(args.serve_args)])
            try:
                stack.enter_context(served)
            except RuntimeError as exc:
                raise UsageError(str(exc)) from exc
            url, pid = served.url, served.pid
        try:
            result = abuse.run(url, passes, mix, args.served_model_name, args.api_key,
                               args.timeout, pid)
        except (RuntimeError, OSError) as exc:
            raise UsageError(f"--url {url}: {exc}") from exc
    columns = [Column(phase, f"{args.clients} normal clients {phase}",
                      [result.figures(phase)]) for phase in ("abused", "alone")]
    title = (f"quire bench abuse: {args.clients} streaming clients ({args.input_len} in, "
             f"{args.output_len} out) alone and beside abusive clients, {url}")
    notes = [f"{kind}: {outcomes}" for kind, outcomes in result.outcomes.items()]
    settings = {"url": url, "model": result.model, "clients": args.clients,
                "input_len": args.input_len, "output_len": args.output_len,
                "warmup": args.warmup, "mix": dataclasses.asdict(mix),
                "server_pid": pid}
    payload = record("abuse", settings, columns, abusers=result.outcomes)
    _finish(args, title, comparison_table(abuse.ABUSE_FIGURES, columns), notes, payload)
    return 0


# -- sweep ---------------------------------------------------------------------------------
def _swept(args: argparse.Namespace) -> tuple[str, list[int], dict[str, int]]:
    """The option with several values, its values, and the options with one value."""
    from quire.bench.sweep import parse_values

    lists = {}
    for option in SWEEP_OPTIONS:
        text = getattr(args, option)
        if text is not None:
            try:
                lists[option] = parse_values(str(text))
            except ValueError as exc:
                raise UsageError(f"--{option.replace('_', '-')}: {exc}") from exc
    swept = [o for o, values in lists.items() if len(values) > 1]
    if len(swept) != 1:
        flags = ", ".join("--" + o.replace("_", "-") for o in SWEEP_OPTIONS)
        raise UsageError(f"give several comma-separated values to exactly one of {flags}")
    fixed = {o: values[0] for o, values in lists.items() if len(values) == 1}
    return swept[0], lists[swept[0]], fixed


def run_sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from quire.bench.report import THROUGHPUT_FIGURES, figure_rows, record
    from quire.bench.sweep import plot
    from quire.bench.sweep import run_sweep as sweep
    from quire.config import EngineConfig
    from quire.model_store import model_path_of
    from quire.tokenizer import load_tokenizer

    spec = _workload(args)
    param, values, fixed = _swept(args)
    if args.plot:
        require("matplotlib", "--plot")
    # the swept option and any not given take EngineConfig's defaults (the sweep parser
    # reads them as text, so args holds None or a string for each)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    base = argparse.Namespace(**{**vars(args), **{o: defaults[o] for o in SWEEP_OPTIONS},
                                 **fixed})
    config = engine_config_from_args(base)
    try:
        tokenizer = load_tokenizer(config.tokenizer or model_path_of(config))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if config.max_model_len:
        _check_fits(spec, config.max_model_len)
    runs = _requests(spec, tokenizer, config.model, args)
    try:
        points = sweep(config, param, values, runs, open_registry(args), args.warmup)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    flag = param.replace("_", "-")
    title = (f"quire bench sweep: {flag} over {values}, {spec.name} ({spec.description}), "
             f"median of {args.repeats}, model {config.model}")
    table = figure_rows(THROUGHPUT_FIGURES, {str(p.value): p.figures for p in points}, flag)
    if args.plot:
        plot(points, param, args.plot, title=f"{spec.name}: throughput and KV memory per {flag}")
    notes = [f"plot written to {args.plot}"] if args.plot else []
    settings = _settings(spec, args, engine=dataclasses.asdict(config), swept=param,
                         values=values)
    payload = record("sweep", settings, points=[dataclasses.asdict(p) for p in points])
    _finish(args, title, table, notes, payload)
    return 0


# -- memory --------------------------------------------------------------------------------
def run_memory(args: argparse.Namespace) -> int:
    import dataclasses

    from quire.bench.corpus import ByteSource, Corpus
    from quire.bench.memory import KVBudget, compare
    from quire.bench.report import MEMORY_FIGURES, figure_rows, record
    from quire.bench.workloads import build_requests

    spec = _workload(args)
    try:
        budget = KVBudget.parse(args.kv_memory)
        per_token = None if budget.bytes is None else _kv_bytes_per_token(args)
        tokens = budget.to_tokens(per_token)
        requests = build_requests(spec, Corpus(ByteSource()))
        results = compare(requests, tokens, args.block_size, args.max_model_len,
                          args.enable_prefix_caching == "true")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    title = (f"quire bench memory: {spec.name} ({spec.description}), KV budget "
             f"{tokens} tokens, block size {args.block_size}, max_model_len "
             f"{args.max_model_len}")
    table = figure_rows(MEMORY_FIGURES, {r.policy: r.figures() for r in results}, "policy")
    payload = record("memory", {"workload": dataclasses.asdict(spec),
                                "kv_budget_tokens": tokens, "kv_bytes_per_token": per_token,
                                "block_size": args.block_size,
                                "max_model_len": args.max_model_len},
                     policies=[dataclasses.asdict(r) for r in results])
    _finish(args, title, table, [], payload)
    return 0


def _kv_bytes_per_token(args: argparse.Namespace) -> int:
    from quire.bench.memory import kv_bytes_per_token
    from quire.config import parse_dtype
    from quire.model_store import resolve_model
    from quire.models.loader import load_model_config

    if args.dtype in ("int8", "fp8"):  # quantised pages: float16 scales beside each row
        return kv_bytes_per_token(load_model_config(resolve_model(args.model)), 1,
                                  quantized=True)
    dtype = parse_dtype(args.dtype)
    if dtype is None:
        raise ValueError("--dtype: give a dtype name, not 'auto'")
    return kv_bytes_per_token(load_model_config(resolve_model(args.model)), dtype.itemsize)


# -- install-peer --------------------------------------------------------------------------
def run_install_peer(args: argparse.Namespace) -> int:
    from quire.bench.peers.install import install, is_installed

    spec = PEERS[args.name]
    if not args.force and is_installed(spec):
        print(f"{spec.name} is already installed in {spec.venv()} (--force to reinstall)")
        return 0
    rc = install(spec)
    print(f"{spec.name}: {'installed' if rc == 0 else f'failed (exit {rc})'}; log: {spec.log()}")
    return rc
