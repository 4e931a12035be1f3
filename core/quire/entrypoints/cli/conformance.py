"""``quire conformance``: run the conformance suite against one platform and print a table.

Exit status: 0 when nothing failed; 1 when a check failed, or when ``--require-available``
is given and something could not run because the platform (or, in kernels-only mode, its
backend) is not available here; 2 for a usage error. A platform that is not available is
reported, not failed: every check that needs it reads "not available: <reason>".

``--kernels-only`` sets ``TRITON_INTERPRET=1`` in this process's environment before any
plugin is imported (plugins are imported only when the registry is opened, in :func:`run`),
so Triton kernels run on host tensors. If triton was imported earlier without it, the
command refuses to run rather than test compiled kernels that cannot run here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import torch

from quire.entrypoints.cli.common import UsageError, open_registry

TRITON_INTERPRET = "TRITON_INTERPRET"
#: Kept in step with quire.conformance.runner.CHECK_IDS (a test checks it), so that
#: building the parser, which every command does, does not import the suite.
_CHECK_IDS = ("platform", "kv-write", "attention", "layer-ops", "moe", "embedding",
              "quant-linear", "kv-quant", "lora", "memory", "communicator", "end-to-end")


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="check a platform plugin against the cpu reference",
        description="Run the conformance suite against one platform: platform contract, "
        "KV writes, paged attention, layer ops (norm, activations), MoE ops, embedding "
        "ops, memory profiler, communicator and "
        "end-to-end generation, each compared with the cpu reference. See docs/conformance.md.",
    )
    parser.add_argument("--device", required=True, metavar="NAME",
                        help="the platform to check (a name from 'quire plugins')")
    parser.add_argument("--kernels-only", action="store_true",
                        help="run only the attention and KV checks, with the platform's "
                        "backend on host tensors (sets TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", action="append", metavar="DTYPES",
                        help="dtypes to test, comma-separated or repeated "
                        "(default: every dtype the platform declares)")
    parser.add_argument("--block-size", action="append", type=int, metavar="N",
                        help="block sizes to test, repeated; the first must work (default: "
                        "the platform's default, then 16 or 32, then 3)")
    parser.add_argument("--check", action="append", choices=_CHECK_IDS, metavar="ID",
                        help=f"run only these checks, repeated ({', '.join(_CHECK_IDS)})")
    parser.add_argument("--require-available", action="store_true",
                        help="exit 1 when the platform is not available here (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random input")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.kernels_only:
        enable_triton_interpreter(os.environ, "triton" in sys.modules)
    from quire.conformance.runner import ConformanceOptions, run_by_name

    try:
        options = ConformanceOptions(
            kernels_only=args.kernels_only,
            dtypes=_parse_dtypes(args.dtype),
            block_sizes=tuple(args.block_size) if args.block_size else None,
            checks=tuple(args.check) if args.check else None,
            seed=args.seed,
        )
        registry = open_registry(args)
        name = registry.auto_choice() if args.device.strip().lower() == "auto" else args.device
        report = run_by_name(registry, name, options)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"quire conformance: platform '{report.platform}', mode {report.mode}, "
          f"device {report.device}")
    for line in report.table():
        print(line)
    print(report.summary())
    if report.unavailable_reason:
        then = "exit status 1 (--require-available)" if args.require_available else (
            "exit status 0; pass --require-available to make this an error")
        print(f"platform '{report.platform}' is not available here: "
              f"{report.unavailable_reason}; nothing that needs it was run ({then})")
    return report.exit_code(args.require_available)


def enable_triton_interpreter(environ: MutableMapping[str, str], triton_imported: bool) -> None:
    """Set ``TRITON_INTERPRET=1`` for kernels-only mode.

    :raises UsageError: triton is imported already and was not told to interpret: it read
        the variable at import, so setting it now would change nothing.
    """
    if triton_imported and environ.get(TRITON_INTERPRET) != "1":
        raise UsageError(f"--kernels-only: triton was imported before {TRITON_INTERPRET}=1 "
                         f"could be set; run with {TRITON_INTERPRET}=1 in the environment")
    environ[TRITON_INTERPRET] = "1"


def _parse_dtypes(values: list[str] | None) -> tuple[torch.dtype, ...] | None:
    if not values:
        return None
    from quire.config import parse_dtype

    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    dtypes = []
    for name in names:
        try:
            dtype = parse_dtype(name)
        except ValueError as exc:  # names the accepted names
            raise ValueError(f"--dtype: {exc}") from None
        if dtype is None:
            raise ValueError("--dtype: 'auto' is not a dtype to test; name one")
        dtypes.append(dtype)
    return tuple(dict.fromkeys(dtypes))
