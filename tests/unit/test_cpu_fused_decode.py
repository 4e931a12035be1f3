"""The fused C decoder layer (quire/platforms/cpu/fused_decode.py) against the same
model run op by op.

A tiny Llama whose weights are rounded to bf16 (so every linear has a compact copy)
is prepared twice: with the native kernels (fused layers) and without (packed linears,
torch norms and attention). Prompts are prefilled, then tokens are decoded one at a
time; every decode step's logits must agree within ``rtol = atol = 1e-4`` (float32
sums in other orders, through two layers and the LM head, as in
test_cpu_packed_linear.py), and the KV caches the two wrote must agree too. Every C
path is covered: a decode step of one sequence on compact weights
(``decode_layer_f32``), of one or many sequences on float32 panels
(``decode_batch_f32``), and prompts and mixed steps through the layer's halves around
the attention backend (``layer_front_f32``/``layer_back_f32``), whose logits are
compared too. The families' variations the layer description carries (biases, windows,
Qwen3's q/k norms, Gemma's offset norms, sandwich norms and GELU-tanh) each run every
path. Layers that do not qualify must keep the op-by-op path.
"""

from __future__ import annotations

import pytest
import torch
from native_builds import no_panels_reason
from quire.distributed import TorchDistributedCommunicator
from quire.engine.scheduler import ScheduledSeq
from quire.engine.sequence import Sequence
from quire.engine.step_items import step_item
from quire.executor.model_runner import ModelRunner
from quire.models.gemma3 import Gemma3ForCausalLM
from quire.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from quire.models.moe import Qwen3MoeForCausalLM
from quire.platforms.cpu.fused_decode import FusedDecodeLayer, install_fused_decode
from quire.platforms.cpu.native import LinearArgs, NativeKernels
from quire.platforms.cpu.native_norm import install_norm_kernels
from quire.platforms.cpu.packed_linear import (
    PackedLinear,
    onednn_available,
    pack_linear_weights,
)
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.sampling_params import SamplingParams
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

BLOCK = 4
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _model(config, cls=LlamaForCausalLM, unrounded: tuple[str, ...] = ()) -> LlamaForCausalLM:
    """Weights rounded to bf16 (each linear gets a compact copy) except the parameters
    whose names contain one of ``unrounded`` (full float32 mantissas: panels only)."""
    model = cls(config, TorchDistributedCommunicator("gloo", 0, 1))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = torch.randn(param.shape, generator=gen) * 0.2
            param.copy_(value if any(u in name for u in unrounded)
                        else value.bfloat16().float())
    return model.eval()


class Counting:
    """Wraps the C entry point to count the calls that went through it."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


class Run:
    """One model, its caches and runner; sequences decode greedily step by step."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64,
                 dtype: torch.dtype = torch.float32) -> None:
        self.backend = CpuSdpaAttentionBackend()
        self.caches = [self.backend.allocate_kv_cache(num_blocks, BLOCK, model.num_kv_heads,
                                                      model.head_dim, dtype,
                                                      torch.device("cpu"))
                       for _ in range(model.num_layers)]
        self.runner = ModelRunner(model, self.backend, self.caches, BLOCK, torch.device("cpu"))

    def step(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        return self.runner.execute([step_item(s) for s in scheduled]).logits


def _seq(seq_id: int, prompt: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(prompt),
                   params=SamplingParams(max_tokens=64))
    seq.block_table = list(blocks)
    return seq


def _pair(config, kernels: NativeKernels, compact: bool = True, num_blocks: int = 64,
          unrounded: tuple[str, ...] = ()):
    """(fused run, op-by-op run, counter of the single-sequence kernel's calls, counter
    of the batch kernel's calls); without ``compact`` the fused layers keep only panels.
    The fused layers' halves (prompts, mixed steps) are counted in ``Run.halves``.
    ``config`` may be ``(config, model class)``."""
    config, cls = config if isinstance(config, tuple) else (config, LlamaForCausalLM)
    fused, plain = _model(config, cls, unrounded), _model(config, cls, unrounded)
    pack_linear_weights(fused, kernels, compact=compact)
    install_norm_kernels(fused, kernels)
    assert install_fused_decode(fused, kernels) == {"fused": config.num_hidden_layers}
    pack_linear_weights(plain)  # no native kernels: torch norms, split float32 products
    single = Counting(kernels.decode_layer_f32)
    batch = Counting(kernels.decode_batch_f32)
    halves = Counting(kernels.layer_front_f32)
    for layer in fused.model.layers:
        assert isinstance(layer.kernel, FusedDecodeLayer)
        layer.kernel.native = _Proxy(kernels, single, batch, halves)
    run = Run(fused, num_blocks)
    run.halves = halves
    return run, Run(plain, num_blocks), single, batch


class _Proxy:
    def __init__(self, kernels: NativeKernels, single: Counting, batch: Counting,
                 halves: Counting) -> None:
        self._kernels, self.decode_layer_f32, self.decode_batch_f32 = kernels, single, batch
        self.layer_front_f32 = halves

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def _assert_same_caches(fused: Run, plain: Run, seqs: list[Sequence]) -> None:
    """Every slot the sequences wrote, keys and values, in every layer."""
    for a, b in zip(fused.caches, plain.caches):
        for seq in seqs:
            for pos in range(seq.num_tokens):
                block, offset = seq.block_table[pos // BLOCK], pos % BLOCK
                torch.testing.assert_close(a[:, block, offset], b[:, block, offset],
                                           rtol=1e-5, atol=1e-5)


CONFIGS = {
    "llama": LlamaConfig(**COMMON),
    "llama-biases": LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "qwen2-qkv-bias": Qwen2Config(**COMMON),
    "mistral-window-5": MistralConfig(**COMMON, sliding_window=5),
    # SiLU runs eight lanes at a time: 100 leaves a tail of four
    "llama-inter-100": LlamaConfig(**{**COMMON, "intermediate_size": 100}),
    "qwen3-qk-norm": (Qwen3Config(**COMMON, head_dim=16), Qwen3ForCausalLM),
    # (1 + w) norms, sandwich norms, GELU-tanh, a window on one layer of two
    "gemma3": (Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=5,
                                query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention"]),
               Gemma3ForCausalLM),
    # a dense layer, then one whose experts run outside the C layer
    "qwen3-moe": (Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                 mlp_only_layers=[0]), Qwen3MoeForCausalLM),
}


def _skip_unless_compact_fits(name: str, compact: bool) -> None:
    config = CONFIGS[name][0] if isinstance(CONFIGS[name], tuple) else CONFIGS[name]
    if compact and config.intermediate_size % 32:
        pytest.skip("compact weights need the down projection's inputs in blocks of 32")


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "panels"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_sequence_decodes_like_the_op_by_op_path(kernels: NativeKernels, name: str,
                                                     compact: bool) -> None:
    if not compact and not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    _skip_unless_compact_fits(name, compact)
    fused, plain, single, batch = _pair(CONFIGS[name], kernels, compact)
    taken = single if compact else batch
    prompt = [5, 17, 90, 3, 64, 11, 7]
    seqs = [_seq(0, prompt, [9, 2, 30, 4, 17, 6]), _seq(0, prompt, [9, 2, 30, 4, 17, 6])]
    prompt_logits = [run.step([ScheduledSeq(seq, 0, len(prompt))])
                     for run, seq in zip((fused, plain), seqs)]
    assert single.calls == batch.calls == 0  # a prompt is not a decode step...
    if kernels.has_panel_gemm:  # ...it runs the layer's halves around the backend
        assert fused.halves.calls == 2
    torch.testing.assert_close(prompt_logits[0], prompt_logits[1], rtol=1e-4, atol=1e-4)
    for n in range(12):  # past a page boundary and the window
        start = seqs[0].num_tokens
        token = (7 * n + 3) % 96
        got, want = [], []
        for run, seq, out in zip((fused, plain), seqs, (got, want)):
            seq.output_token_ids.append(token)
            out.append(run.step([ScheduledSeq(seq, start, 1)]))
        assert taken.calls == 2 * (n + 1)  # both layers, every step
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert single.calls + batch.calls == taken.calls
    _assert_same_caches(fused, plain, seqs[:1])


@pytest.mark.parametrize("name", ["llama", "llama-biases", "gemma3", "qwen3-moe"])
def test_a_bfloat16_model_decodes_a_lone_sequence_in_c(kernels: NativeKernels,
                                                       name: str) -> None:
    """A bfloat16 model's lone sequence runs the C layer: rows widened to float32,
    weights streamed from their compact bf16 copies, KV pages in bfloat16 (written
    rounded). Oracle: the same weights in a float32 model; tolerance ``atol=0.05,
    rtol=0.02`` on logits (bfloat16 keeps 8 bits; gaps seen up to 0.032 at logits of 7.8,
    where the op-by-op bfloat16 path was 0.044 away). The pages it wrote hold the
    float32 run's keys and values to bfloat16 rounding."""
    config, cls = CONFIGS[name] if isinstance(CONFIGS[name], tuple) else (CONFIGS[name],
                                                                          LlamaForCausalLM)
    reference, fused = _model(config, cls), _model(config, cls).to(torch.bfloat16)
    pack_linear_weights(fused, kernels)
    install_norm_kernels(fused, kernels)
    assert install_fused_decode(fused, kernels) == {"fused": config.num_hidden_layers}
    single = Counting(kernels.decode_layer_f32)
    for layer in fused.model.layers:
        layer.kernel.native = _Proxy(kernels, single, Counting(kernels.decode_batch_f32),
                                     Counting(kernels.layer_front_f32))
    runs = (Run(reference), Run(fused, dtype=torch.bfloat16))
    prompt = [5, 17, 90, 3, 64, 11, 7]
    seqs = [_seq(0, prompt, [9, 2, 30, 4, 17, 6]) for _ in runs]
    for run, seq in zip(runs, seqs):
        run.step([ScheduledSeq(seq, 0, len(prompt))])
    for n in range(12):  # past a page boundary and the window
        start = seqs[0].num_tokens
        outs = []
        for run, seq in zip(runs, seqs):
            seq.output_token_ids.append((7 * n + 3) % 96)
            outs.append(run.step([ScheduledSeq(seq, start, 1)]))
        want, got = outs
        assert got.dtype == torch.float32  # the LM head's logits
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
    assert single.calls == 12 * config.num_hidden_layers
    for ref_cache, cache in zip(runs[0].caches, runs[1].caches):
        assert cache.dtype == torch.bfloat16
        for pos in range(seqs[0].num_tokens):
            block, offset = seqs[0].block_table[pos // BLOCK], pos % BLOCK
            torch.testing.assert_close(cache[:, block, offset].float(),
                                       ref_cache[:, block, offset], rtol=2**-6, atol=0.02)


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3-moe"])
def test_a_layer_mixing_compact_and_panel_weights_decodes_a_lone_sequence(
        kernels: NativeKernels, name: str) -> None:
    """A GGUF file mixes block formats: weights with an exact compact encoding beside
    others (K-quants) without. The one-row layer streams the first and runs the panel
    kernel on the rest, in the same call."""
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    fused, plain, single, batch = _pair(CONFIGS[name], kernels,
                                        unrounded=("o_proj", "down_proj"))
    layer = fused.runner.model.model.layers[0].kernel
    formats = [args.format for args in layer._compact_args]
    assert LinearArgs.PANELS in formats and set(formats) != {LinearArgs.PANELS}
    prompt = [5, 17, 90, 3, 64, 11, 7]
    seqs = [_seq(0, prompt, [9, 2, 30, 4, 17, 6]), _seq(0, prompt, [9, 2, 30, 4, 17, 6])]
    for run, seq in zip((fused, plain), seqs):
        run.step([ScheduledSeq(seq, 0, len(prompt))])
    for n in range(6):
        start, got = seqs[0].num_tokens, []
        for run, seq in zip((fused, plain), seqs):
            seq.output_token_ids.append((11 * n + 5) % 96)
            got.append(run.step([ScheduledSeq(seq, start, 1)]))
        torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    assert single.calls == 2 * 6 and batch.calls == 0
    _assert_same_caches(fused, plain, seqs[:1])


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "panels"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_decode_batch_decodes_like_the_op_by_op_path(kernels: NativeKernels, name: str,
                                                       compact: bool) -> None:
    """Seven sequences of different lengths (more rows than one 6-row tile of the panel
    kernel), on scattered pages, through the batch kernel, compact copies or not."""
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    _skip_unless_compact_fits(name, compact)
    fused, plain, single, batch = _pair(CONFIGS[name], kernels, compact)
    gen = torch.Generator().manual_seed(5)
    pages = torch.randperm(64, generator=gen).tolist()
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (1, 9, 4, 6, 2, 13, 5)]
    tables = [pages[8 * i: 8 * i + 8] for i in range(len(prompts))]
    runs, prompt_logits = [], []
    for run in (fused, plain):
        seqs = [_seq(i, p, t) for i, (p, t) in enumerate(zip(prompts, tables))]
        prompt_logits.append(
            run.step([ScheduledSeq(seq, 0, len(seq.prompt_token_ids)) for seq in seqs]))
        runs.append(seqs)
    assert single.calls == batch.calls == 0 and fused.halves.calls == 2
    torch.testing.assert_close(prompt_logits[0], prompt_logits[1], rtol=1e-4, atol=1e-4)
    for n in range(10):
        got = []
        for run, seqs in zip((fused, plain), runs):
            scheduled = []
            for i, seq in enumerate(seqs):
                seq.output_token_ids.append((5 * n + 3 * i + 1) % 96)
                scheduled.append(ScheduledSeq(seq, seq.num_tokens - 1, 1))
            got.append(run.step(scheduled))
        assert batch.calls == 2 * (n + 1) and single.calls == 0
        torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    _assert_same_caches(fused, plain, runs[0])


def test_a_long_prompt_crosses_the_halves_row_blocks(kernels: NativeKernels) -> None:
    """600 prompt rows: the halves take 256 rows at a time (BLOCK_ROWS), each block with
    its own rows' rotary factors, residual and outputs."""
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": 1024})
    fused, plain, _, _ = _pair(config, kernels, num_blocks=160)
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 96, (600,), generator=gen).tolist()
    pages = torch.randperm(160, generator=gen)[:151].tolist()
    seqs = [_seq(0, prompt, pages), _seq(0, prompt, pages)]
    got = [run.step([ScheduledSeq(seq, 0, len(prompt))]) for run, seq in zip((fused, plain), seqs)]
    assert fused.halves.calls == 2
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    _assert_same_caches(fused, plain, seqs[:1])


def test_a_mixed_step_runs_the_halves_around_the_backend(kernels: NativeKernels) -> None:
    """A decode row beside a prompt: not a pure decode step, so no whole-layer call;
    with panels, the layer's halves in C and the backend's attention between them."""
    fused, plain, single, batch = _pair(CONFIGS["llama"], kernels)
    results = []
    for run in (fused, plain):
        a, b = _seq(0, [3, 4, 5, 6, 7], [1, 2, 3]), _seq(1, [40, 41, 42], [4, 5, 6])
        run.step([ScheduledSeq(a, 0, 5)])
        a.output_token_ids.append(8)
        results.append(run.step([ScheduledSeq(a, 5, 1), ScheduledSeq(b, 0, 3)]))
    assert single.calls == batch.calls == 0
    assert fused.halves.calls == (4 if kernels.has_panel_gemm else 0)
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)


def test_layers_that_do_not_qualify_keep_no_kernel(kernels: NativeKernels) -> None:
    model = _model(CONFIGS["llama"])
    pack_linear_weights(model)  # without native kernels: no compact copies, no panels
    assert install_fused_decode(model, kernels) == {
        "linears with neither a compact copy nor panels": 2}
    odd = _model(CONFIGS["llama"])
    odd.model.layers[1].post_attention_layernorm.eps = 1e-3  # the C layer takes one eps
    pack_linear_weights(odd, kernels)
    assert install_fused_decode(odd, kernels) == {"fused": 1,
                                                  "norms with different eps": 1}
    assert odd.model.layers[1].kernel is None


def test_float32_weights_qualify_on_panels_only(kernels: NativeKernels) -> None:
    if not kernels.has_panel_gemm:
        pytest.skip(no_panels_reason(kernels))
    unrounded = LlamaForCausalLM(CONFIGS["llama"], TorchDistributedCommunicator("gloo", 0, 1))
    with torch.no_grad():
        for param in unrounded.parameters():
            param.normal_()  # full float32 mantissas: no exact compact encoding
    pack_linear_weights(unrounded, kernels)
    assert install_fused_decode(unrounded, kernels) == {"fused": 2}
    for layer in unrounded.model.layers:
        assert layer.kernel._compact is None and layer.kernel._panels is not None


def test_the_platform_installs_it_unless_compact_copies_are_off(
    monkeypatch: pytest.MonkeyPatch, kernels: NativeKernels
) -> None:
    from quire.platforms.cpu.options import ENV_DEFAULTS
    from quire.platforms.cpu.platform import CpuPlatform

    monkeypatch.delenv(ENV_DEFAULTS["compact"], raising=False)
    platform = CpuPlatform()
    monkeypatch.setattr(platform, "_native_kernels", lambda: kernels)
    model = _model(CONFIGS["llama"])
    platform.prepare_model(model)
    assert all(isinstance(layer.kernel, FusedDecodeLayer) for layer in model.model.layers)
    platform.configure({"compact": "false"})
    model = _model(CONFIGS["llama"])
    platform.prepare_model(model)
    if kernels.has_panel_gemm:  # still fused, on the panels alone
        assert all(layer.kernel._compact is None and layer.kernel._panels is not None
                   for layer in model.model.layers)
    else:
        assert all(layer.kernel is None for layer in model.model.layers)
    assert model.lm_head.kernel.compact is None  # panels where the kernel is, else oneDNN
    assert (model.lm_head.kernel.panels is not None) == kernels.has_panel_gemm
    monkeypatch.setenv(ENV_DEFAULTS["compact"], "maybe")
    with pytest.raises(ValueError, match=ENV_DEFAULTS["compact"]):
        platform.configure({})


class _Bf16Proxy:
    """The kernels with the bfloat16 layer's attention entry points and its whole-layer
    decode batch counted."""

    def __init__(self, kernels: NativeKernels, attend: Counting, rotate: Counting,
                 batch: Counting) -> None:
        self._kernels, self.rows_attend, self.rows_rotate = kernels, attend, rotate
        self.decode_batch_bf16 = batch

    def __getattr__(self, name):
        return getattr(self._kernels, name)


@pytest.mark.parametrize("route", ["per-product", "whole-layer"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "no-compact"])
@pytest.mark.parametrize("name", ["llama", "qwen2-qkv-bias", "mistral-window-5",
                                  "qwen3-qk-norm", "gemma3", "qwen3-moe"])
def test_a_bfloat16_model_runs_batches_in_c(
        kernels: NativeKernels, name: str, compact: bool, route: str) -> None:
    """A bfloat16 model's prompt step (the attention backend between the C pieces, each
    product on its own kernel) and decode batches of seven sequences. ``per-product``:
    every product on oneDNN, the C pieces between them, attention in C;
    ``whole-layer`` (levels with the pair-panel kernel): each decode batch's layer in
    one ``quire_decode_batch_bf16`` call, its products on pair panels.
    Oracles: the same weights in a float32 model, and the op-by-op bfloat16 path.
    Tolerance ``rtol=0.02, atol=0.08`` on logits for both: bfloat16 keeps 8 bits, the
    bfloat16 paths round at different points (the C pieces keep the residual stream in
    float32 through a layer, the whole layer every activation but the products'
    inputs). Worst gaps seen: Gemma 3 0.045 from float32 and 0.062 from op by op (op by
    op itself 0.053 from float32), the others 0.008 and 0.012 (op by op 0.011). Without
    compact copies a lone sequence's decode step takes the batch path too. The pages
    hold the float32 run's keys and values to bfloat16 rounding. Fails if the expected
    C entry points (attention or whole layer for decode, rotary for the prompt) are
    not taken."""
    if route == "whole-layer" and not kernels.has_bf16_gemm:
        pytest.skip(f"level {kernels.level} has no bfloat16 pair-panel kernel")
    config, cls = CONFIGS[name] if isinstance(CONFIGS[name], tuple) else (CONFIGS[name],
                                                                          LlamaForCausalLM)
    reference = _model(config, cls)
    fused, plain = (_model(config, cls).to(torch.bfloat16) for _ in range(2))
    pack_linear_weights(fused, kernels, compact=compact)
    if route == "per-product":
        for module in fused.modules():
            if isinstance(getattr(module, "kernel", None), PackedLinear):
                module.kernel.use_onednn()
    install_norm_kernels(fused, kernels)
    assert install_fused_decode(fused, kernels) == {"fused": config.num_hidden_layers}
    pack_linear_weights(plain)  # bfloat16 oneDNN products, torch for the rest
    attend, rotate = Counting(kernels.rows_attend), Counting(kernels.rows_rotate)
    batch = Counting(kernels.decode_batch_bf16)
    for layer in fused.model.layers:
        layer.kernel.native = _Bf16Proxy(kernels, attend, rotate, batch)
    runs = (Run(reference), Run(fused, dtype=torch.bfloat16),
            Run(plain, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(5)
    pages = torch.randperm(64, generator=gen).tolist()
    sizes = (1, 9, 4, 6, 2, 13, 5) if compact else (6,)  # one row: no compact copies
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in sizes]
    tables = [pages[8 * i: 8 * i + 8] for i in range(len(prompts))]
    seqs = [[_seq(i, p, t) for i, (p, t) in enumerate(zip(prompts, tables))] for _ in runs]

    def compare(outs: list[torch.Tensor]) -> None:
        want, got, plain_got = outs
        assert got.dtype == torch.float32  # the LM head's logits
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.08)
        torch.testing.assert_close(got, plain_got, rtol=0.02, atol=0.08)

    compare([run.step([ScheduledSeq(s, 0, len(s.prompt_token_ids)) for s in run_seqs])
             for run, run_seqs in zip(runs, seqs)])
    assert rotate.calls == config.num_hidden_layers and attend.calls == 0
    for n in range(10):  # past page boundaries and the window
        outs = []
        for run, run_seqs in zip(runs, seqs):
            for i, seq in enumerate(run_seqs):
                seq.output_token_ids.append((5 * n + 3 * i + 1) % 96)
            outs.append(run.step([ScheduledSeq(s, s.num_tokens - 1, 1) for s in run_seqs]))
        compare(outs)
        decode_calls = batch if route == "whole-layer" else attend
        assert decode_calls.calls == (n + 1) * config.num_hidden_layers
        assert (attend if route == "whole-layer" else batch).calls == 0
    for ref_cache, cache in zip(runs[0].caches, runs[1].caches):
        assert cache.dtype == torch.bfloat16
        for seq in seqs[0]:
            for pos in range(seq.num_tokens):
                block, offset = seq.block_table[pos // BLOCK], pos % BLOCK
                torch.testing.assert_close(cache[:, block, offset].float(),
                                           ref_cache[:, block, offset], rtol=2**-6, atol=0.03)


def test_the_bfloat16_pieces_round_the_residual_stream_as_torch_does(
        kernels: NativeKernels) -> None:
    """quire_rows_front then quire_rows_post_attn with a zero attention output: the
    residual they return is x + residual summed in float32 and rounded to nearest even,
    bit for bit as torch rounds (ties, a width with an 8-lane tail, inf and NaN)."""
    import ctypes

    from quire.platforms.cpu.native import LayerDescArgs, RowsArgs

    gen = torch.Generator().manual_seed(3)
    rows, hidden = 5, 67
    x = (torch.randn(rows, hidden, generator=gen) * 4).bfloat16()
    residual = (torch.randn(rows, hidden, generator=gen) * 4).bfloat16()
    x[0, :8] = 1.0
    residual[0, :8] = 2.0 ** -8  # 1 + 2^-8: a tie, to even (1.0)
    x[1, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    ones = torch.ones(hidden)
    desc = LayerDescArgs(1e-6, 0, ones.data_ptr(), ones.data_ptr(), None, None, None, None,
                         0, 1)
    stream = torch.empty(rows, hidden)
    normed, out = torch.empty_like(x), torch.empty_like(x)
    zeros = torch.zeros_like(x)
    args = RowsArgs(rows=rows, hidden=hidden, hq=1, hkv=1, d=2,
                    desc=ctypes.pointer(desc), x=x.data_ptr(),
                    residual=residual.data_ptr(), stream=stream.data_ptr(),
                    normed=normed.data_ptr(), o_out=zeros.data_ptr(),
                    residual_out=out.data_ptr())
    assert kernels.rows_front(ctypes.byref(args)) == 0
    assert kernels.rows_post_attn(ctypes.byref(args)) == 0
    want = (x.float() + residual.float()).bfloat16()
    assert torch.equal(out.view(torch.int16)[~want.isnan()],
                       want.view(torch.int16)[~want.isnan()])
    assert torch.equal(out.isnan(), want.isnan())
    assert float(out[0, 0]) == 1.0


def test_a_bfloat16_mixed_step_runs_the_c_pieces_around_the_backend(
        kernels: NativeKernels) -> None:
    """A decode row beside a prompt in a bfloat16 model: not a pure decode step, so the
    C pieces rotate q and k in place and the backend writes the cache and attends.
    Oracles and tolerance as the batch test's: float32 weights, and op by op."""
    config = CONFIGS["llama"]
    reference = _model(config)
    fused, plain = (_model(config).to(torch.bfloat16) for _ in range(2))
    pack_linear_weights(fused, kernels)
    install_norm_kernels(fused, kernels)
    assert install_fused_decode(fused, kernels) == {"fused": config.num_hidden_layers}
    pack_linear_weights(plain)
    attend, rotate = Counting(kernels.rows_attend), Counting(kernels.rows_rotate)
    batch = Counting(kernels.decode_batch_bf16)
    for layer in fused.model.layers:
        layer.kernel.native = _Bf16Proxy(kernels, attend, rotate, batch)
    results = []
    for run in (Run(reference), Run(fused, dtype=torch.bfloat16),
                Run(plain, dtype=torch.bfloat16)):
        a, b = _seq(0, [3, 4, 5, 6, 7], [1, 2, 3]), _seq(1, [40, 41, 42], [4, 5, 6])
        run.step([ScheduledSeq(a, 0, 5)])
        a.output_token_ids.append(8)
        results.append(run.step([ScheduledSeq(a, 5, 1), ScheduledSeq(b, 0, 3)]))
    assert rotate.calls == 2 * config.num_hidden_layers and attend.calls == batch.calls == 0
    want, got, plain_got = results
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.08)
    torch.testing.assert_close(got, plain_got, rtol=0.02, atol=0.08)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_sequence_s_verification_rows_run_whole_in_c_like_the_op_by_op_path(
        kernels: NativeKernels, name: str) -> None:
    """Speculative decoding's step for one sequence (its last token and its drafts, 2 to
    8 rows after its cached context) runs the whole layer in C on the compact weights
    (``quire_decode_rows_f32``), and gives the op-by-op path's logits and cache."""
    _skip_unless_compact_fits(name, True)
    fused, plain, _, _ = _pair(CONFIGS[name], kernels, compact=True)
    rows_calls = Counting(kernels.decode_rows_f32)
    for layer in fused.runner.model.model.layers:
        layer.kernel.native.decode_rows_f32 = rows_calls
    prompt = [5, 17, 90, 3, 64, 11, 7]
    table = [9, 2, 30, 4, 17, 6, 21, 22, 23, 24]
    seqs = [_seq(0, prompt, table), _seq(0, prompt, table)]
    for run, seq in zip((fused, plain), seqs):
        run.step([ScheduledSeq(seq, 0, len(prompt))])
    expected_calls = 0
    for n, rows in enumerate((2, 3, 4, 5, 8, 2)):  # past page boundaries and the window
        start = seqs[0].num_tokens
        tokens = [(11 * n + 5 * i + 3) % 96 for i in range(rows)]
        got, want = [], []
        for run, seq, out in zip((fused, plain), seqs, (got, want)):
            seq.output_token_ids.append(tokens[0])
            out.append(run.step([ScheduledSeq(seq, start, rows, spec=tuple(tokens[1:]))]))
            seq.output_token_ids += tokens[1:]  # every draft accepted
        expected_calls += 2  # both layers
        assert rows_calls.calls == expected_calls
        assert got[0].shape == (rows, 96)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    _assert_same_caches(fused, plain, seqs[:1])
