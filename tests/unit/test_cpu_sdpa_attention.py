"""The cpu platform's SDPA attention against a dense float64 oracle and the reference.

Inputs are random N(0, 1) from a seeded generator (never zeros); physical blocks are a
random permutation with spare blocks, block-table padding holds random valid ids, and
every slot no sequence has written holds NaN, so reading one shows in the output.

Each case is a list of ``(cached prefix, new tokens)`` per sequence: decode rows (one
new token), whole prompts (no prefix), chunks after a cached prefix (prefix-cache hits
and chunked prefill), and all of them mixed in one step.

Tolerances: float32 ``rtol = atol = 1e-5`` against float64 (SDPA accumulates in
float32; the gap seen is ~1e-6). bfloat16 ``2e-2``: both sides see the same bf16
inputs; the output is rounded to bf16 (relative step 2**-8) and SDPA keeps its running
softmax sums in float32 but rounds probabilities to bf16 before multiplying values.
Against the reference backend in float32: ``1e-5`` as well.

Every case runs twice: with the torch ops only, and with the native C kernels
(:mod:`quire.platforms.cpu.native`), which take the decode rows, the whole prompts and
the chunks after a cached prefix (windows too) without a soft cap and must meet the same
tolerances.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedCase, make_paged_case
from quire.interfaces.attention import AttentionBatch
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.native import NativeKernels, load_native_kernels
from quire.platforms.cpu.platform import CpuPlatform
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend

HEAD_SIZE = 16
NUM_KV_HEADS = 3

SHAPES = {
    "decode": [(4, 1), (15, 1), (40, 1), (0, 1), (7, 1)],
    "prompts": [(0, 5), (0, 23), (0, 1), (0, 9)],
    "prefixed": [(9, 9), (16, 5), (3, 30), (1, 2)],
    "mixed": [(0, 7), (5, 1), (13, 6), (16, 1), (0, 1), (2, 20), (30, 1), (0, 11)],
    "one_prompt": [(0, 37)],
    "one_chunk": [(21, 12)],
    "prompt_and_decode": [(6, 1), (0, 19), (11, 1)],
}
FEATURES = {
    "plain": (None, None),
    "window": (5, None),
    "wide_window": (1000, None),
    "softcap": (None, 2.0),
    "window+softcap": (6, 1.5),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    kernels = load_native_kernels()  # prebuilt, or built into the suite's kept cache
    if kernels is None:  # tests/unit/test_cpu_native.py fails on its own when cc exists
        pytest.skip("native kernels could not be built here (no C compiler?)")
    return kernels


@pytest.fixture(params=["torch", "native"])
def backend(request: pytest.FixtureRequest) -> CpuSdpaAttentionBackend:
    if request.param == "torch":
        return CpuSdpaAttentionBackend()
    return CpuSdpaAttentionBackend(native=request.getfixturevalue("native"))


def make_case(seqs: list[tuple[int, int]], block_size: int, group: int, dtype: torch.dtype,
              seed: int) -> PagedCase:
    """Unwritten slots hold NaN: a backend that reads one shows it."""
    return make_paged_case(seqs, block_size, group, dtype, num_kv_heads=NUM_KV_HEADS,
                           head_size=HEAD_SIZE, seed=seed)

def dense_float64(case: PagedCase, scale: float, window: int | None,
                  cap: float | None) -> torch.Tensor:
    """One sequence at a time over contiguous K/V, float64, HF repeat_interleave GQA."""
    outs = []
    starts = case.batch.query_start_loc.tolist()
    for i, seq_len in enumerate(case.batch.seq_lens.tolist()):
        q = case.query[starts[i]:starts[i + 1]].double()
        g = q.shape[1] // NUM_KV_HEADS
        k = case.full_keys[i].double().repeat_interleave(g, dim=1)
        v = case.full_values[i].double().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        p = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        allowed = j <= p
        if window is not None:
            allowed &= j > p - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run(backend: ReferenceAttentionBackend, case: PagedCase, scale: float, window: int | None,
        cap: float | None, *, fused: bool = True) -> torch.Tensor:
    """Through ``forward`` (write then attend, the model's call) or the two calls apart."""
    cache = case.kv_cache.clone()
    metadata = backend.build_metadata(case.batch)
    if fused:
        return backend.forward(case.query, case.key, case.value, cache, metadata,
                               scale=scale, sliding_window=window, logits_soft_cap=cap)
    backend.write_kv(case.key, case.value, cache, metadata)
    return backend.attend(case.query, cache, metadata, scale=scale, sliding_window=window,
                          logits_soft_cap=cap)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_matches_dense_float64(
    backend: CpuSdpaAttentionBackend, group: int, block_size: int, shape: str, feature: str
) -> None:
    window, cap = FEATURES[feature]
    case = make_case(SHAPES[shape], block_size, group, torch.float32,
                     seed=block_size * 7 + group)
    scale = HEAD_SIZE**-0.5
    expected = dense_float64(case, scale, window, cap)
    for fused in (True, False):
        out = run(backend, case, scale, window, cap, fused=fused)
        assert out.shape == case.query.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["mixed", "prefixed", "one_prompt"])
@pytest.mark.parametrize("feature", ["plain", "window+softcap"])
def test_bfloat16_matches_dense(
    backend: CpuSdpaAttentionBackend, shape: str, feature: str
) -> None:
    window, cap = FEATURES[feature]
    case = make_case(SHAPES[shape], 7, 3, torch.bfloat16, seed=11)
    out = run(backend, case, 0.3, window, cap)
    assert out.dtype == torch.bfloat16
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), dense_float64(case, 0.3, window, cap),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window", [None, 4])
def test_matches_the_reference_backend(
    backend: CpuSdpaAttentionBackend, shape: str, window: int | None
) -> None:
    case = make_case(SHAPES[shape], 16, 3, torch.float32, seed=5)
    ours = run(backend, case, 0.25, window, None)
    reference = run(ReferenceAttentionBackend(), case, 0.25, window, None)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_metadata_serves_layers_with_different_windows(
    backend: CpuSdpaAttentionBackend,
) -> None:
    """One metadata, layers alternating windows (Qwen2-style): each mask is its own."""
    cases = [make_case(SHAPES["mixed"], 7, 3, torch.float32, seed=s) for s in (1, 1, 1)]
    metadata = backend.build_metadata(cases[0].batch)
    for case, window in zip(cases, (3, None, 3)):
        cache = case.kv_cache.clone()
        out = backend.forward(case.query, case.key, case.value, cache, metadata, scale=0.3,
                              sliding_window=window)
        torch.testing.assert_close(out.double(), dense_float64(case, 0.3, window, None),
                                   rtol=1e-5, atol=1e-5)


def test_writes_exactly_what_the_reference_writes() -> None:
    case = make_case(SHAPES["mixed"], 7, 3, torch.float32, seed=2)
    ours, reference = case.kv_cache.clone(), case.kv_cache.clone()
    sdpa = CpuSdpaAttentionBackend()
    sdpa.write_kv(case.key, case.value, ours, sdpa.build_metadata(case.batch))
    ref = ReferenceAttentionBackend()
    ref.write_kv(case.key, case.value, reference, ref.build_metadata(case.batch))
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))  # NaN == NaN


def test_bad_inputs_are_refused() -> None:
    case = make_case(SHAPES["decode"], 7, 1, torch.float32, seed=0)
    backend = CpuSdpaAttentionBackend()
    narrow = AttentionBatch(**{**case.batch.__dict__,
                               "block_tables": case.batch.block_tables[:, :1]})
    with pytest.raises(ValueError, match="needs 6 blocks"):
        backend.build_metadata(narrow)
    metadata = backend.build_metadata(case.batch)
    with pytest.raises(ValueError):
        backend.attend(case.query, case.kv_cache, metadata, scale=1.0, sliding_window=0)


def test_the_platform_defaults_to_sdpa_and_can_pick_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QUIRE_CPU_ATTENTION", raising=False)
    assert isinstance(CpuPlatform().make_attention_backend(), CpuSdpaAttentionBackend)
    platform = CpuPlatform()
    platform.configure({"attention": "reference"})
    assert type(platform.make_attention_backend()) is ReferenceAttentionBackend
    with pytest.raises(ValueError, match="attention=.fast."):
        CpuPlatform().configure({"attention": "fast"})
    monkeypatch.setenv("QUIRE_CPU_ATTENTION", "reference")  # a variable sets the default
    assert type(CpuPlatform().make_attention_backend()) is ReferenceAttentionBackend
    platform = CpuPlatform()
    platform.configure({"attention": "sdpa"})  # the option wins over the variable
    assert isinstance(platform.make_attention_backend(), CpuSdpaAttentionBackend)
    monkeypatch.setenv("QUIRE_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="QUIRE_CPU_ATTENTION"):
        CpuPlatform().configure({})


@pytest.mark.parametrize("seqs", [[(7, 1), (0, 1), (33, 1)], [(0, 1), (0, 1)], [(40, 1)]])
def test_a_decode_step_s_group_is_the_general_one(seqs: list[tuple[int, int]]) -> None:
    """A decode step's metadata takes a short path (``_decode_group``): every field the
    general one (``_build_group``) gives, value for value, one-token prompts included."""
    from quire.platforms.cpu.sdpa_attention import _build_group, _decode_group

    batch = make_case(seqs, 16, 2, torch.float32, seed=5).batch
    seq_lens = batch.seq_lens.tolist()
    fast = _decode_group(batch, seq_lens)
    general = _build_group(batch, list(range(len(seqs))), seq_lens)
    for name in ("tables", "q_pos", "decode_tables", "lens"):
        got, want = getattr(fast, name), getattr(general, name)
        assert got.dtype == want.dtype and got.is_contiguous() == want.is_contiguous()
        assert torch.equal(got, want), name
    for name in ("token_idx", "padded_idx", "block_size", "num_seqs", "max_q", "key_len",
                 "fresh_rows", "rows"):
        assert getattr(fast, name) == getattr(general, name), name
    metadata = CpuSdpaAttentionBackend().build_metadata(batch)
    assert len(metadata.groups) == 1 and metadata.groups[0].rows == general.rows
