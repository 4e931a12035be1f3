"""Which parts of each registered architecture run natively on the cpu platform.

For every architecture the core registers, a tiny random checkpoint is served by
``LLM`` on the cpu platform with its C kernels, and prompts are prefilled and decoded
(a batch, then a lone sequence). A decoder family is supported natively when every one
of its decoder layers got the platform's whole-layer kernel and no linear or norm site
inside a layer ran op by op during those steps: a family that silently falls back to
torch ops fails here. An MoE layer's experts run through the platform's ``fused_moe``
op after the C layer stops at the MLP's input, so sites inside that MLP are allowed.
An encoder (embedding task) has no decoder layer: its linears must run on the packed
kernels.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from native_builds import no_panels_reason
from quire import LLM, SamplingParams
from quire.models.registry import CORE_MODELS
from quire.platforms.cpu.native import load_native_kernels
from quire.platforms.cpu.packed_linear import PackedLinear
from tiny_models import build_checkpoint

#: Registered architecture -> the tiny checkpoint that stands for it.
DECODERS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
#: Architectures checked by the encoder test below, or by another name's checkpoint.
ENCODERS = {"BertModel"}
#: Architectures whose class runs a checked architecture's forward unchanged (a subclass
#: that only reads its checkpoint differently): MiMo is Qwen2 with its MTP layers unread.
ALIASES: dict[str, str] = {"MiMoForCausalLM": "Qwen2ForCausalLM"}
#: Image-text architectures -> (the tiny checkpoint's builder module and function, the
#: placeholder in prompts): their decoders must fuse as the text families' do, with
#: image rows in the step.
IMAGE_MODELS = {
    "LlavaForConditionalGeneration": ("tiny_vlm", "build_llava", "<image>"),
    "LlavaNextForConditionalGeneration": ("tiny_llava_next", "build_llava_next", "<image>"),
    "Idefics3ForConditionalGeneration": ("tiny_idefics3", "build_idefics3", "<image>"),
    "Qwen2_5_VLForConditionalGeneration": (
        "tiny_qwen2_5_vl", "build_qwen2_5_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
    "Gemma3ForConditionalGeneration": ("tiny_gemma3_vlm", "build_gemma3_vlm",
                                       "<start_of_image>"),
}


@pytest.fixture(scope="module")
def native():
    kernels = load_native_kernels()  # the best level this CPU runs
    if kernels is None:
        pytest.skip("no native kernels (turned off, or no prebuilt library fits and none "
                    "builds here; the log says which): the fused layers need them")
    if not kernels.has_panel_gemm:
        pytest.skip(f"{no_panels_reason(kernels)}: the fused layers need panels")
    return kernels


def test_every_registered_architecture_is_checked() -> None:
    unchecked = (set(CORE_MODELS) - set(DECODERS) - ENCODERS - set(ALIASES)
                 - set(IMAGE_MODELS))
    assert not unchecked, f"architectures without a native-ops check: {sorted(unchecked)}"


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_runs_its_checked_architectures_forward(alias: str) -> None:
    cls, checked = CORE_MODELS[alias].load(), CORE_MODELS[ALIASES[alias]].load()
    assert issubclass(cls, checked), f"{alias} is not a {ALIASES[alias]}"
    assert cls.forward is checked.forward, f"{alias} has its own forward: check it natively"


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.worker.model


def _count_site_calls(model: torch.nn.Module) -> tuple[Counter, list]:
    """Hooks counting forward calls of every linear/norm site inside a decoder layer,
    except inside an MLP the platform leaves to the model (``spec.mlp``)."""
    calls: Counter = Counter()
    handles = []
    for layer_name, layer in model.named_modules():
        describe = getattr(layer, "fusion_spec", None)
        if describe is None:
            continue
        external = describe().mlp
        skipped = set() if external is None else {id(m) for m in external.modules()}
        for name, module in layer.named_modules():
            if getattr(module, "op_site", None) and id(module) not in skipped:
                key = f"{layer_name}.{name}"

                def hook(*_, key=key):
                    calls[key] += 1

                handles.append(module.register_forward_hook(hook))
    return calls, handles


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_decoder_layers_run_natively(arch: str, native, tmp_path) -> None:
    path = build_checkpoint(DECODERS[arch], tmp_path / arch)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128,
              platform_options={"native": "true", "linear": "packed"})
    model = _model(llm)
    layers = [m for m in model.modules() if hasattr(m, "fusion_spec")]
    assert layers, f"{arch}: no decoder layer publishes a fusion_spec"
    assert all(type(layer.kernel).__name__ == "FusedDecodeLayer" for layer in layers), (
        f"{arch}: layers without the whole-layer kernel: "
        f"{[i for i, layer in enumerate(layers) if layer.kernel is None]}")
    calls, handles = _count_site_calls(model)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate([[5, 9, 13, 40, 41, 42, 7, 8, 9, 10, 11],
                             [100, 101, 102, 103]], params)  # prefill + decode batch
        outs += llm.generate([[33, 34, 35]], params)  # a lone sequence's decode steps
    finally:
        for handle in handles:
            handle.remove()
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert not calls, f"{arch}: sites that ran op by op: {dict(calls)}"
    moe = [layer for layer in layers if layer.fusion_spec().mlp is not None]
    if "Moe" in arch or "Mixtral" in arch:
        assert moe, f"{arch}: no layer leaves its experts to the fused_moe op"


@pytest.mark.parametrize("arch", sorted(IMAGE_MODELS))
def test_image_models_decoders_run_natively(arch: str, native, tmp_path) -> None:
    """The language model of an image-text model fuses whole layers with image rows in
    the step (their embeddings placed before the first layer), and its vision tower's
    linears run on the packed kernels."""
    import importlib

    from tiny_vlm import image

    module, builder, placeholder = IMAGE_MODELS[arch]
    path = getattr(importlib.import_module(module), builder)(tmp_path / "vlm")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256,
              platform_options={"native": "true", "linear": "packed"})
    model = _model(llm)
    layers = [m for m in model.modules() if hasattr(m, "fusion_spec")]
    assert layers and all(type(layer.kernel).__name__ == "FusedDecodeLayer"
                          for layer in layers), f"{arch}: layers without the whole-layer kernel"
    tower = [m for name, m in model.named_modules() if name.startswith(("vision_tower",
             "visual", "vision_model")) and getattr(m, "op_site", None) == "linear"]
    assert tower and all(isinstance(m.kernel, PackedLinear) for m in tower), arch
    calls, handles = _count_site_calls(model)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = llm.generate({"prompt": f"Look {placeholder} here",
                             "multi_modal_data": {"image": image(40, 30, 1)}}, params)
    finally:
        for handle in handles:
            handle.remove()
    assert len(outs[0].outputs[0].token_ids) == 4
    assert not calls, f"{arch}: sites that ran op by op: {dict(calls)}"


def test_encoder_linears_run_on_packed_kernels(native, tmp_path) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=64)
    path = tmp_path / "bert"
    BertModel(config).save_pretrained(path)
    llm = LLM(model=str(path), task="embed", dtype="float32",
              tokenizer=str(build_checkpoint("llama", tmp_path / "tok")))
    linears = [m for m in _model(llm).modules() if getattr(m, "op_site", None) == "linear"]
    assert linears and all(isinstance(m.kernel, PackedLinear) for m in linears)
