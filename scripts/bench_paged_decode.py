"""The cpu platform's paged decode attention (csrc/paged_decode.c, attend_heads.h) on
SmolLM2's decode shapes, A/B against a baseline revision of its sources, in microseconds.

``OMP_WAIT_POLICY=PASSIVE python scripts/bench_paged_decode.py --baseline-rev REV``
builds two libraries of one ISA level (default: the best this CPU runs) from this
checkout's ``csrc/``, one as it is and one with REV's ``attend_heads.h``,
``paged_decode.c``, ``cpu_kernels.h`` and the kernels that share it in their place, then times the entry
``quire_paged_decode_f32``/``_bf16`` (and ``_quant`` for int8 and fp8 pages, where a
build has it: a baseline without it shows "-") of both on every case (64 sequences of
one context length, Hq=9, Hkv=3, D=64, pages of 16 in shuffled order; and one sequence
of 2048, the latency path), at each thread count, the two interleaved round after round
(a shared host's load hits both alike); each cell keeps its best round.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import tempfile
from pathlib import Path

import torch
from kernel_ab import add_arguments, best_seconds, level_of, libraries
from quire.ops import kv_quant
from quire.platforms.cpu.native import KV_TYPES
from quire.platforms.cpu.threads import configure_threads

HQ, HKV, D, BLOCK = 9, 3, 64, 16
#: (sequences, context length)
CASES = ((64, 32), (64, 128), (64, 192), (64, 256), (1, 2048))
#: the baseline's files (the other kernels include cpu_kernels.h too, so they come along)
SOURCES = ("attend_heads.h", "paged_decode.c", "cpu_kernels.h", "decode_layer.c",
           "prompt_attention.c")
#: the page kinds timed, by their dtype
KINDS = {"f32": torch.float32, "bf16": torch.bfloat16, "i8": torch.int8,
         "fp8": torch.float8_e4m3fn}


def _entries(library: ctypes.CDLL) -> dict:
    entries = {"f32": library.quire_paged_decode_f32, "bf16": library.quire_paged_decode_bf16}
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                ptr]
    for entry in entries.values():
        entry.restype = ctypes.c_int
        entry.argtypes = argtypes
    quant = getattr(library, "quire_paged_decode_quant", None)
    if quant is not None:
        quant.restype = ctypes.c_int
        quant.argtypes = [ctypes.c_int32, *argtypes]
        for kind in ("i8", "fp8"):
            entries[kind] = functools.partial(quant, KV_TYPES[KINDS[kind]])
    return entries


def _case(seqs: int, length: int, dtype: torch.dtype, layers: int,
          gen: torch.Generator) -> tuple:
    """Query, the layers' caches, tables, lengths and output of one case, pages in
    shuffled order."""
    per_seq = -(-length // BLOCK)
    num_blocks = seqs * per_seq
    caches = [torch.randn(2, num_blocks, BLOCK, HKV, D, generator=gen) for _ in range(layers)]
    caches = [kv_quant.quantize(c, dtype).view(dtype) if kv_quant.is_quantized(dtype)
              else c.to(dtype) for c in caches]
    tables = torch.randperm(num_blocks, generator=gen).view(seqs, per_seq).contiguous()
    lens = torch.full((seqs,), length, dtype=torch.int64)
    q = torch.randn(seqs, HQ, D, generator=gen)
    return q, caches, tables, lens, torch.empty_like(q)


def _time(entry, case, budget_s: float) -> float:
    """Best seconds per step (one call per layer) over steps spanning about ``budget_s``."""
    q, caches, tables, lens, out = case
    half = caches[0][0].numel() * caches[0].element_size()
    calls = [(q.data_ptr(), cache.data_ptr(), cache.data_ptr() + half, tables.data_ptr(),
              tables.stride(0), lens.data_ptr(), q.shape[0], HQ, HKV, D, BLOCK, D ** -0.5,
              0, out.data_ptr()) for cache in caches]

    def step() -> None:
        for args in calls:
            entry(*args)
    return best_seconds(step, budget_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "attention sources", rounds=5)
    parser.add_argument("--layers", type=int, default=30,
                        help="layers per step, each with its own pages")
    args = parser.parse_args()
    level = level_of(args)
    gen = torch.Generator().manual_seed(0)
    cases = [(kv, seqs, length, _case(seqs, length, dtype, args.layers, gen))
             for kv, dtype in KINDS.items() for seqs, length in CASES]
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {which: _entries(lib) for which, lib in
                libraries(args.baseline_rev, SOURCES, level, Path(tmp)).items()}
        for _ in range(args.rounds):
            for threads in args.threads:
                configure_threads(threads)
                for kv, seqs, length, case in cases:
                    for which, entries in libs.items():
                        if kv not in entries:
                            continue
                        took = _time(entries[kv], case, args.budget)
                        key = (threads, kv, seqs, length, which)
                        best[key] = min(best.get(key, float("inf")), took)
    print(f"level {level.name}, baseline {args.baseline_rev}, best of {args.rounds} rounds, "
          f"{args.layers} layers, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("threads  kv    seqs  context   base us    new us  base/new  (per step)")
    for threads in args.threads:
        for kv, seqs, length, _ in cases:
            new = best[(threads, kv, seqs, length, "new")] * 1e6
            base = best.get((threads, kv, seqs, length, "base"))
            if base is None:
                print(f"{threads:7d}  {kv:4s} {seqs:5d} {length:8d} {'-':>9s} {new:9.1f} "
                      f"{'-':>9s}")
                continue
            base *= 1e6
            print(f"{threads:7d}  {kv:4s} {seqs:5d} {length:8d} {base:9.1f} {new:9.1f} "
                  f"{base / new:9.2f}")


if __name__ == "__main__":
    main()
