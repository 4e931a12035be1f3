"""The measured choice between our panel kernel and oneDNN (quire.platforms.cpu.dispatch).

The decision is a pure function of the CPU's features and timings: tested on made-up
hosts. The wiring is tested on a tiny Llama: only the products no fused layer claims
are considered, the winner's layout is the one kept, results stay those of F.linear,
and cached timings are read instead of measured.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_builds import no_panels_reason
from quire.distributed import TorchDistributedCommunicator
from quire.models.llama import LlamaForCausalLM
from quire.platforms.cpu import dispatch
from quire.platforms.cpu.dispatch import (
    ONEDNN,
    PANELS,
    ROWS,
    TimingCache,
    candidates,
    choose,
    describe_cache,
    dispatch_linears,
    host_key,
    split_choice,
)
from quire.platforms.cpu.fused_decode import install_fused_decode
from quire.platforms.cpu.isa import CpuFeatures
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.native_norm import install_norm_kernels
from quire.platforms.cpu.packed_linear import (
    PackedLinear,
    onednn_available,
    pack_linear_weights,
)
from transformers import LlamaConfig

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

ZEN3 = CpuFeatures.of("x86_64", ["avx2", "fma"])
ZEN4 = CpuFeatures.of("x86_64", ["avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                 "avx512dq", "avx512_bf16", "avx512_vnni"])
OLD_X86 = CpuFeatures.of("x86_64", [])
GRAVITON = CpuFeatures.of("aarch64", ["asimd", "asimdhp", "asimddp"])


def _timings(panels: float, onednn: float) -> dict[str, dict[int, float]]:
    return {PANELS: {r: panels for r in ROWS}, ONEDNN: {r: onednn for r in ROWS}}


def test_candidates_follow_the_features() -> None:
    assert candidates(ZEN4, has_panels=True, onednn=True) == (PANELS, ONEDNN)
    assert candidates(ZEN3, has_panels=True, onednn=False) == (PANELS,)
    assert candidates(GRAVITON, has_panels=True, onednn=True) == (PANELS, ONEDNN)
    # below AVX2 there is no panel kernel to run, whatever the build says
    assert candidates(OLD_X86, has_panels=True, onednn=True) == (ONEDNN,)
    assert candidates(ZEN4, has_panels=False, onednn=True) == (ONEDNN,)
    assert candidates(OLD_X86, has_panels=False, onednn=False) == ()


def test_choose_keeps_ours_unless_another_is_clearly_faster() -> None:
    both = (PANELS, ONEDNN)
    assert choose(both, _timings(panels=1.0, onednn=0.7)) == ONEDNN
    assert choose(both, _timings(panels=1.0, onednn=0.97)) == PANELS  # within the margin
    assert choose(both, _timings(panels=0.5, onednn=1.0)) == PANELS
    assert choose(both, _timings(panels=1.0, onednn=0.96), margin=0.0) == ONEDNN
    # the sum over the row counts decides: a loss at 64 rows outweighs a win at 8
    mixed = {PANELS: {8: 0.010, 64: 0.100}, ONEDNN: {8: 0.005, 64: 0.120}}
    assert choose(both, mixed, rows=(8, 64)) == PANELS
    assert choose(both, mixed, rows=(8,)) == ONEDNN  # a regime of its own
    # timings missing for a row count: that candidate is not considered
    assert choose(both, {PANELS: {8: 1.0, 64: 1.0}, ONEDNN: {8: 0.1}}, (8, 64)) == PANELS
    assert choose(both, {ONEDNN: {8: 0.1, 64: 0.1}}, (8, 64)) == PANELS  # incumbent unmeasured
    assert choose((ONEDNN,), {}) == ONEDNN
    with pytest.raises(ValueError, match="no implementation"):
        choose((), {})


def test_one_row_moves_to_another_layout_only_when_clearly_faster_there() -> None:
    both = (PANELS, ONEDNN)
    batches_onednn = {8: 1.0, 64: 2.0}
    clear = {PANELS: {1: 1.0, 8: 2.0, 64: 4.0}, ONEDNN: {1: 1.5, **batches_onednn}}
    assert split_choice(both, clear) == (ONEDNN, PANELS)
    tie = {PANELS: {1: 1.0, 8: 2.0, 64: 4.0}, ONEDNN: {1: 1.02, **batches_onednn}}
    assert split_choice(both, tie) == (ONEDNN, ONEDNN)  # one copy of the weight
    assert split_choice(both, _timings(panels=1.0, onednn=2.0)) == (PANELS, PANELS)


def test_the_host_key_changes_with_what_the_timings_depend_on() -> None:
    base = host_key(ZEN4, "avx512", 2, "AMD EPYC")
    assert base == host_key(ZEN4, "avx512", 2, "AMD EPYC")
    assert len({base, host_key(ZEN3, "avx512", 2, "AMD EPYC"),
                host_key(ZEN4, "avx2", 2, "AMD EPYC"), host_key(ZEN4, "avx512", 4, "AMD EPYC"),
                host_key(ZEN4, "avx512", 2, "Intel Xeon")}) == 5


def test_the_timing_cache_round_trips_and_survives_a_bad_file(tmp_path) -> None:
    path = tmp_path / "host.json"
    cache = TimingCache(path)
    assert cache.get((10, 20)) is None
    cache.put((10, 20), _timings(1.0, 2.0))
    cache.save()
    assert TimingCache(path).get((10, 20)) == _timings(1.0, 2.0)
    path.write_text("{not json")
    assert TimingCache(path).get((10, 20)) is None


def test_quire_plugins_describes_what_a_start_would_choose(tmp_path) -> None:
    cache = TimingCache(tmp_path / "host.json")
    assert "timed at the first start" in describe_cache(cache, ZEN4, True, True)[0]
    assert describe_cache(cache, OLD_X86, True, True) == [
        "linear products: onednn (nothing to choose between on this host)"]
    cache.put((64, 64), _timings(1.0, 0.5))
    cache.put((4096, 512), _timings(0.5, 1.0))
    cache.put((1024, 64), {PANELS: {1: 1.0, 8: 2.0, 64: 4.0},
                           ONEDNN: {1: 1.5, 8: 1.0, 64: 2.0}})
    assert describe_cache(cache, ZEN4, True, True) == [
        "linear [4096x512]: panels (timed here)",
        "linear [1024x64]: panels for one row, onednn for more (timed here)",
        "linear [64x64]: onednn (timed here)"]
    lines = describe_cache(cache, ZEN4, True, True, limit=1)
    assert lines[0] == "linear [4096x512]: panels (timed here)"
    assert lines[1].startswith("... and 2 smaller shapes")


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config, TorchDistributedCommunicator("gloo", 0, 1))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def _prepared(kernels: NativeKernels) -> tuple[LlamaForCausalLM, torch.Tensor]:
    model = _llama()
    head = model.lm_head.weight.detach().clone()
    pack_linear_weights(model, kernels)
    install_norm_kernels(model, kernels)
    fused = install_fused_decode(model, kernels)
    assert fused == {"fused": 2} or not kernels.has_panel_gemm
    return model, head


@pytest.mark.parametrize("winner", [PANELS, ONEDNN])
def test_cached_timings_decide_and_the_winners_layout_is_kept(
        kernels: NativeKernels, tmp_path, monkeypatch, winner: str) -> None:
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    model, head = _prepared(kernels)
    cache = TimingCache(tmp_path / "host.json")
    cache.put((300, 64), _timings(1.0, 0.5) if winner == ONEDNN else _timings(0.5, 1.0))
    monkeypatch.setattr(dispatch, "_measure", lambda *a: pytest.fail("measured anyway"))
    decisions = dispatch_linears(model, cache, ZEN4)
    # the decoder layers' products belong to their fused layers: only the head is chosen
    assert [(d.site, d.shape, d.chosen, d.cached) for d in decisions] == [
        ("lm_head", (300, 64), winner, True)]
    kernel = model.lm_head.kernel
    assert kernel.impl == winner
    assert (kernel.panels is None) == (winner == ONEDNN)
    assert (kernel.packed is None) == (winner == PANELS)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(kernel(x, None), F.linear(x, head), atol=1e-5, rtol=1e-5)
    # the fused layers kept their panels
    for layer in model.model.layers:
        assert layer.self_attn.qkv_proj.kernel.panels is not None


def test_a_split_decision_keeps_both_layouts(kernels: NativeKernels, tmp_path,
                                             monkeypatch) -> None:
    """Ours faster for one row, oneDNN for batches: one-row products on the panels,
    the rest on oneDNN, both layouts kept."""
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    model, head = _prepared(kernels)
    cache = TimingCache(tmp_path / "host.json")
    cache.put((300, 64), {PANELS: {1: 1.0, 8: 2.0, 64: 4.0},
                          ONEDNN: {1: 1.5, 8: 1.0, 64: 2.0}})
    (decision,) = dispatch_linears(model, cache, ZEN4)
    assert (decision.chosen, decision.one_row) == (ONEDNN, PANELS)
    assert "panels for one row, onednn for more" in decision.describe()
    kernel = model.lm_head.kernel
    assert kernel.panels is not None and kernel.packed is not None
    calls = []
    real = kernels.panel_linear
    monkeypatch.setattr(kernels, "panel_linear",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, 5, 1, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(kernel(x, None), F.linear(x, head), atol=1e-5, rtol=1e-5)
    assert calls == [1, 1]


def test_a_first_start_measures_and_caches(kernels: NativeKernels, tmp_path) -> None:
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    model, head = _prepared(kernels)
    path = tmp_path / "host.json"
    (decision,) = dispatch_linears(model, TimingCache(path), ZEN4)
    assert not decision.cached and set(decision.timings) == {PANELS, ONEDNN}
    assert all(set(t) == set(ROWS) and all(s > 0 for s in t.values())
               for t in decision.timings.values())
    # the choice is split_choice's (several rows, then one row), not choose over every
    # row: the two disagreed when a loaded host made the one-row timing swing
    assert (decision.chosen, decision.one_row) == split_choice((PANELS, ONEDNN),
                                                               decision.timings)
    assert TimingCache(path).get((300, 64)) == decision.timings
    x = torch.randn(5, 64)
    torch.testing.assert_close(model.lm_head.kernel(x, None), F.linear(x, head),
                               atol=1e-5, rtol=1e-5)
    # a second start reads what the first measured
    again, _ = _prepared(kernels)
    (second,) = dispatch_linears(again, TimingCache(path), ZEN4)
    assert second.cached and second.chosen == decision.chosen


def test_a_forced_implementation_skips_measuring(kernels: NativeKernels, monkeypatch) -> None:
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    model, _ = _prepared(kernels)
    monkeypatch.setattr(dispatch, "_measure", lambda *a: pytest.fail("measured anyway"))
    (decision,) = dispatch_linears(model, None, ZEN4, forced=ONEDNN)
    assert decision.chosen == ONEDNN and model.lm_head.kernel.impl == ONEDNN


def test_a_host_without_the_panel_kernel_has_nothing_to_choose(kernels: NativeKernels) -> None:
    model, _ = _prepared(kernels)
    assert dispatch_linears(model, None, OLD_X86) == []
    assert isinstance(model.lm_head.kernel, PackedLinear)


@pytest.mark.parametrize("winner", [PANELS, ONEDNN])
def test_bfloat16_products_are_chosen_everywhere_before_the_layers_fuse(
        kernels: NativeKernels, tmp_path, monkeypatch, winner: str) -> None:
    """The bfloat16 pass covers the decoder layers' products too, keyed apart from
    float32 timings of the same shapes; the fused layers then run a decode batch's
    layer in one call on pair panels, or product by product where oneDNN won."""
    if not kernels.has_bf16_gemm:
        pytest.skip(f"level {kernels.level} has no bfloat16 pair-panel kernel")
    model = _llama().to(torch.bfloat16)
    pack_linear_weights(model, kernels)
    cache = TimingCache(tmp_path / "host.json")
    shapes = {(300, 64), (64 + 2 * 32, 64), (64, 64), (2 * 96, 64), (64, 96)}
    fast, slow = (_timings(0.5, 1.0), _timings(1.0, 0.5))
    for shape in shapes:
        cache.put(shape, fast if winner == PANELS else slow, "bf16")
        cache.put(shape, slow if winner == PANELS else fast)  # float32's: not read
    monkeypatch.setattr(dispatch, "_measure", lambda *a: pytest.fail("measured anyway"))
    decisions = dispatch_linears(model, cache, ZEN4, bfloat16=True)
    assert {d.shape for d in decisions} == shapes and len(decisions) == 2 * 4 + 1
    assert all(d.chosen == winner and d.cached for d in decisions)
    assert dispatch_linears(model, cache, ZEN4) == []  # float32's pass: nothing of it
    install_norm_kernels(model, kernels)
    assert install_fused_decode(model, kernels) == {"fused": 2}
    for layer in model.model.layers:
        assert (layer.kernel._panels is not None) == (winner == PANELS)
        assert layer.kernel._products is not None
    assert "linear bf16 [300x64]" in "\n".join(describe_cache(cache, ZEN4, True, True))
