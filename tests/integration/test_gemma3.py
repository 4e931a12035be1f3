"""Gemma 3 (text) against transformers float32: tiny random checkpoints in the default
suite, the real Gemma 3 270M (Q4_K_M GGUF) in the slow one.

The tiny checkpoint (``tests/tiny_models.py``) has one sliding layer (window 8, shorter
than the prompts) and one full layer with its own rope (linear-scaled), a
``query_pre_attn_scalar`` that is not the head size and a final logit soft cap; the
engine scenarios of ``test_hf_parity.py`` cover it too. Here: logprobs, the layer kinds
and rope tables, the GGUF names and configs, and the real model end to end.
"""

from __future__ import annotations

import pytest
import torch
from quire import LLM, SamplingParams
from quire.distributed import TorchDistributedCommunicator
from quire.models.gemma3 import (
    Gemma3ForCausalLM,
    gemma3_layer_types,
    gemma3_rope_parameters,
)
from quire.models.gguf_file import hf_tensor_name
from quire.models.registry import resolve_architecture
from quire.ops import reference_ops
from tiny_gguf import write_tiny_gemma3_gguf
from tiny_models import hf_model, tiny_config

TEXTS = [
    "Once upon a time there was a quiet village by the sea, where the fishermen told",
    "The capital of France is",
    "Attention is all you need; paged attention keeps the cache in fixed-size blocks of",
]


@torch.inference_mode()
def _hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each of ``tokens`` after ``prompt``."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@torch.inference_mode()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """:func:`tiny_models.hf_greedy` with only the last position's logits computed, as
    transformers' ``generate`` does (a 262k vocabulary makes the rest the cost)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _check_greedy_and_logprobs(llm: LLM, reference: torch.nn.Module, prompts: list[list[int]],
                               max_tokens: int, tol: float) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got == _hf_greedy(reference, prompt, max_tokens), prompt
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got)]
        theirs = _hf_logprobs(reference, prompt, got)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < tol


def _one_rank() -> TorchDistributedCommunicator:
    return TorchDistributedCommunicator("gloo")


# -- tiny random checkpoints ---------------------------------------------------------------

def test_tiny_greedy_and_logprobs_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    llm = LLM(str(path), device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    assert max(len(p) for p in prompts) > tiny_config("gemma3").sliding_window
    _check_greedy_and_logprobs(llm, hf_model(path), prompts, 16, 1e-4)


def test_config_without_architectures_resolves_by_model_type():
    config = tiny_config("gemma3")
    config.architectures = None
    assert config.model_type == "gemma3_text"
    assert resolve_architecture(config) is Gemma3ForCausalLM


def test_layer_kinds_windows_and_rope_tables_follow_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = tiny_config("gemma3")
    model = Gemma3ForCausalLM(config, _one_rank())
    assert model.sliding_windows == (8, None)
    assert [layer.self_attn.scale for layer in model.model.layers] == [24**-0.5] * 2
    hf_rope = Gemma3RotaryEmbedding(config)
    positions = torch.arange(40)
    d = config.head_dim
    for kind in ("sliding_attention", "full_attention"):
        cos, sin = model.model.rotary_emb[kind](positions, torch.float32)
        hf_cos, hf_sin = hf_rope(torch.zeros(1), positions[None], kind)
        torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0, d // 2:], hf_sin[0, :, d // 2:], rtol=0, atol=1e-6)


def test_older_configs_name_the_kinds_by_pattern_and_local_base():
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=7, sliding_window_pattern=3, rope_theta=5e5,
                             rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear",
                                                                     "factor": 8.0})
    assert gemma3_layer_types(config) == ("sliding_attention", "sliding_attention",
                                          "full_attention") * 2 + ("sliding_attention",)
    assert gemma3_rope_parameters(config) == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
    }


@pytest.mark.parametrize("change, words", [
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
])
def test_unsupported_settings_are_refused_by_name(change, words):
    config = tiny_config("gemma3")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=words):
        Gemma3ForCausalLM(config, _one_rank())


def test_attention_soft_cap_reaches_the_backend(tiny_checkpoint):
    """transformers' Gemma 3 leaves ``attn_logit_softcapping`` unused; here it caps the
    scores as Gemma 2 does, so it must reach every layer's attention call."""
    config = tiny_config("gemma3")
    config.attn_logit_softcapping = 2.5
    model = Gemma3ForCausalLM(config, _one_rank())
    seen = []

    class Recorder:
        ops = reference_ops()
        kv_slots = None  # the backend writes K/V itself: the attention() route

        def merge_mm(self, embeds):  # a text step: no image rows
            return embeds

        def attention(self, layer_idx, q, k, v, *, scale, sliding_window, logits_soft_cap):
            seen.append((layer_idx, sliding_window, logits_soft_cap))
            return q

    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.model.embed_scale.fill_(config.hidden_size**0.5)
        model(torch.tensor([3, 4, 5]), torch.arange(3), Recorder())
    assert seen == [(0, 8, 2.5), (1, None, 2.5)]


def test_gguf_names_of_the_sandwich_norms():
    assert hf_tensor_name("blk.2.attn_norm.weight", "gemma3") == \
        "model.layers.2.input_layernorm.weight"
    assert hf_tensor_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3") == \
        "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_q_norm.weight", "gemma3") == \
        "model.layers.2.self_attn.q_norm.weight"
    # Llama's ffn_norm is the post-attention norm: the table is per architecture
    assert hf_tensor_name("blk.2.ffn_norm.weight") == \
        "model.layers.2.post_attention_layernorm.weight"


def test_tiny_gguf_matches_transformers_loading_the_same_file(tmp_path, tiny_checkpoint):
    """The GGUF path end to end: config built from gemma3 metadata, names, norms stored
    as ``weight + 1``, dequantisation; the oracle is transformers reading the same file."""
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3_gguf(path)
    reference = hf_model(tmp_path, gguf_file=path.name)
    # the file has no vocabulary; the tiny checkpoint's tokenizer has the same 384 ids
    llm = LLM(str(path), tokenizer=str(tiny_checkpoint("gemma3")), device="cpu",
              dtype="float32")
    assert llm.engine.core.executor.worker.model.sliding_windows == (8,) * 5 + (None,)
    tok = llm.get_tokenizer()
    _check_greedy_and_logprobs(llm, reference, [tok.encode(t) for t in TEXTS], 16, 1e-4)


# -- the real Gemma 3 270M (Q4_K_M) --------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]
#: Gemma's turn format (the GGUF file, from the base model, carries no chat template).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def gemma3_gguf():
    from quire.model_store import BUILTIN_MODELS, fetch

    return fetch(BUILTIN_MODELS["gemma3-270m"])


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_gguf):
    return hf_model(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_gguf):
    return LLM(str(gemma3_gguf), device="cpu", dtype="float32", max_model_len=1024)


@pytest.mark.slow
def test_real_gguf_greedy_and_logprobs_match_transformers(gemma3_llm, gemma3_reference):
    tok = gemma3_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in PROMPTS]
    _check_greedy_and_logprobs(gemma3_llm, gemma3_reference, prompts, 32, 1e-3)


@pytest.mark.slow
def test_real_gguf_text_and_chat_end_to_end(gemma3_llm, gemma3_reference):
    tok = gemma3_llm.get_tokenizer()
    text = "The capital of France is"
    [out] = gemma3_llm.generate(text, SamplingParams(temperature=0, max_tokens=12))
    assert out.prompt_token_ids == tok.encode(text) and out.prompt_token_ids[0] == 2  # <bos>
    assert out.outputs[0].token_ids == _hf_greedy(gemma3_reference, out.prompt_token_ids, 12)
    assert "France" in out.outputs[0].text
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids,
                                             skip_special_tokens=True)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(ValueError, match="no chat template"):
        gemma3_llm.chat(messages)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [reply] = gemma3_llm.chat(messages, params, chat_template=GEMMA_CHAT_TEMPLATE)
    ids = reply.prompt_token_ids
    turn = tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids[0] == tok.bos_token_id and ids.count(turn[0]) == 2 and ids.count(turn[1]) == 1
    assert reply.outputs[0].token_ids == _hf_greedy(gemma3_reference, ids, 16)


def test_builtin_name_assembles_the_four_parts():
    from quire.model_store import BUILTIN_MODELS

    model = BUILTIN_MODELS["gemma3-270m"]
    assert model.filename == "gemma-3-270m-q4_k_m.gguf"
    assert [member.rsplit(".", 1)[1] for _, member in model.parts] == \
        ["part00", "part01", "part02", "part03"]
