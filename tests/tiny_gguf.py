"""Tiny GGUF files of random weights for families ``scripts/make_gguf_model.py`` (Llama
only) does not write."""

from __future__ import annotations

import torch

#: GGUF short names of Gemma 3's layer modules (llama.cpp's converter), and the types
#: the tiny file stores them in (every legacy type gguf-py can write; F32 for norms).
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TYPES = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q5_1",
               "ffn_gate": "Q4_0", "ffn_up": "F16", "ffn_down": "Q8_0"}


def write_tiny_gemma3_gguf(path, seed: int = 0) -> None:
    """Six random layers (five sliding, window 8, then a full one: the pattern
    transformers gives a GGUF config) written as llama.cpp's converter does: norms as
    ``weight + 1``, Gemma's names, quantised weights."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
        max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    w = GGUFWriter(str(path), "gemma3")
    for add, value in (("context_length", 256), ("embedding_length", 64),
                       ("block_count", 6), ("feed_forward_length", 96), ("head_count", 4),
                       ("head_count_kv", 2), ("key_length", 32), ("value_length", 32),
                       ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 1e6),
                       ("sliding_window", 8), ("vocab_size", 384)):
        getattr(w, f"add_{add}")(value)
    for name, param in model.named_parameters():
        data = (0.2 if "norm" in name else 0.15) * torch.randn_like(param).numpy()
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", "Q8_0"
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", "F32"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            short = _GGUF_BLOCK[module]
            gguf_name, qtype = f"blk.{layer}.{short}.{kind}", _GGUF_TYPES.get(short, "F32")
        if gguf_name.endswith("norm.weight"):
            data = data + 1
        if qtype in ("F32", "F16"):
            w.add_tensor(gguf_name, data.astype(np.float32 if qtype == "F32" else np.float16))
        else:
            raw = GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name, quantize(data, raw), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
