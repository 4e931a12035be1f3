"""The kernels compile for real GPU targets, checked without a GPU.

The interpreter (the other tests here) runs the kernels' Python, not Triton's compiler, so
it cannot catch code that fails to lower. Triton cross-compiles from any machine: given a
``GPUTarget``, ``triton.compile`` produces a cubin (with the ptxas bundled in the wheel)
or an AMD code object without touching a device. This runs in a fresh interpreter without
``TRITON_INTERPRET``, since this directory's conftest turned it on for this process.

Slow (about a minute on 2 cores). It proves the kernels compile for sm_90 and gfx942,
not that they run correctly there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_COMPILE_ALL = textwrap.dedent(
    """
    import json
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quire.kernels import triton_attention as K

    assert not K.INTERPRETED
    FLOAT_ARGS = {"scale", "soft_cap"}

    def compile_for(fn, target, consts, elem, cache, **options):
        # Arguments named *_ptr are pointers (the K/V caches of type `cache`, their scale
        # views fp32), FLOAT_ARGS fp32, the rest i32 unless given in consts. Pointers and
        # strides are marked 16-divisible, as the JIT infers when launching on 16-aligned
        # tensors.
        missing = [n for n in fn.arg_names if n.isupper() and n not in consts]
        assert not missing, f"{fn.__name__}: constexprs not given {missing}"
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            if name.endswith("_ptr"):
                sig[name] = "*" + ("fp32" if name.startswith("part_") or
                                   name in ("ks_ptr", "vs_ptr") else
                                   "i64" if name == "slot_ptr" else
                                   cache if name in ("k_cache_ptr", "v_cache_ptr") else
                                   "i32" if name.split("_")[0] in
                                   ("block", "query", "seq", "qblock", "decode") else elem)
            else:
                sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=target, options=options)

    results = []
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        # (activations, cache, QUANT): float caches, then int8 and fp8 (read as bytes) KV
        # pages under bfloat16 activations, as _cache_args launches them.
        for elem, cache, quant in (("bf16", "bf16", 0), ("fp32", "fp32", 0),
                                   ("bf16", "i8", 1), ("bf16", "u8", 2)):
            dtype = torch.bfloat16 if elem == "bf16" else torch.float32
            dot_fp32, precision = K._dot_options(dtype)
            common = dict(USE_WINDOW=True, USE_SOFTCAP=True, DOT_FP32=dot_fp32,
                          PRECISION=precision, D_PAD=128)
            attend = dict(QUANT=quant, **common)
            kernels = {
                "prefill": (K._prefill_kernel, dict(GROUP=4, HEADS=4, BLOCK_Q=16,
                                                    BLOCK_M=64, TILE_N=32, **attend)),
                "decode": (K._decode_kernel, dict(GROUP=4, G_PAD=16, NUM_SPLITS=4,
                                                  TILE_N=32, **attend)),
            }
            if quant == 0:  # these two never read the cache's pages as quantised
                kernels["reduce"] = (K._decode_reduce_kernel,
                                     dict(NUM_SPLITS=4, S_PAD=4, D_PAD=128))
                kernels["write"] = (K._write_kv_kernel, dict(H_PAD=8, D_PAD=128))
            for name, (fn, consts) in kernels.items():
                kernel = compile_for(fn, target, consts, elem, cache, num_warps=4,
                                     num_stages=1)
                binary = "cubin" if target.backend == "cuda" else "hsaco"
                results.append([target.backend, str(target.arch), f"{elem}/{cache}", name,
                                len(kernel.asm[binary]) > 0])
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_nvidia_and_amd_targets() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice
    result = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert len(results) == 2 * (2 * 4 + 2 * 2)
    failed = [r for r in results if not r[-1]]
    assert not failed, failed
