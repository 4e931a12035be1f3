"""A tiny random-weight Llama checkpoint with a real tokenizer, built in a directory.

The conformance suite ships inside the core, so it cannot use the repository's test
helpers: this module is its own small copy of the idea. The weights are written straight
to safetensors under Hugging Face's names (no transformers model is built), the config by
``LlamaConfig``, and a byte-level BPE tokenizer is trained on a few sentences with the
``tokenizers`` library, so the engine loads the directory as it would a real checkpoint.

Shape: 2 layers, 4 query heads and 2 KV heads of size 64 (GQA, and a head size every
accelerator kernel supports), hidden size 64, vocabulary 384. Weights are drawn larger
than an initialiser would (0.15 * N(0, 1), norms 1 + 0.2 * N(0, 1)) so the logits are
peaked: greedy decoding then has no near-ties for rounding differences to flip.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
NUM_LAYERS = 2
HIDDEN = 64
INTERMEDIATE = 96
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
MAX_POSITIONS = 1024
#: Ids below this are special tokens (<pad>, <s>, </s>); prompts avoid them.
FIRST_ORDINARY_ID = 3

_CORPUS = (
    "The capital of France is Paris. Paged attention keeps the cache in fixed-size "
    "blocks, and a quire is a set of pages bound together. "
) * 8


def build_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files; return ``directory``."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(directory)
    save_file(_weights(seed), str(directory / "model.safetensors"))
    _tokenizer().save_pretrained(directory)
    return directory


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return 0.15 * torch.randn(rows, cols, generator=gen)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(HIDDEN, generator=gen)

    q_dim, kv_dim = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": matrix(VOCAB, HIDDEN)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(q_dim, HIDDEN),
            p + "self_attn.k_proj.weight": matrix(kv_dim, HIDDEN),
            p + "self_attn.v_proj.weight": matrix(kv_dim, HIDDEN),
            p + "self_attn.o_proj.weight": matrix(HIDDEN, q_dim),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": matrix(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": matrix(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": matrix(HIDDEN, INTERMEDIATE),
        }
    weights["model.norm.weight"] = norm()
    weights["lm_head.weight"] = matrix(VOCAB, HIDDEN)
    return weights


def _tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
