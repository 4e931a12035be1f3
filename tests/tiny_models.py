"""Tiny random-weight checkpoints built from transformers configs, and the HF oracle.

Every checkpoint gets a real (small, byte-level BPE) tokenizer, so string prompts,
EOS handling and detokenization run through the same paths as for a real model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from quire.interfaces.communicator import Communicator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 384
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")

_CORPUS = (
    "The capital of France is Paris. Once upon a time there was a quiet village by "
    "the sea, where the fishermen told stories of pages bound together into a quire. "
    "Attention is all you need; paged attention keeps the cache in fixed-size blocks. "
) * 8


def tiny_config(arch: str) -> PretrainedConfig:
    """A two-layer config of ``arch`` with GQA and each family's own features on."""
    if arch == "llama":
        return LlamaConfig(**_COMMON, tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64},
                           rope_theta=10000.0)
    if arch == "mistral":
        # a window shorter than the prompts, so sliding-window attention is exercised
        return MistralConfig(**_COMMON, sliding_window=12, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False)
    if arch == "gemma3":
        # a sliding layer (window shorter than the prompts, its own rope base) and a full
        # one (linear-scaled rope); query_pre_attn_scalar != head_dim; final soft cap
        return Gemma3TextConfig(
            **_COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                   "rope_theta": 1000000.0},
            },
            final_logit_softcapping=10.0, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        # 8 experts, top 2, on layer 1; layer 0 dense (mlp_only_layers)
        return Qwen3MoeConfig(**_COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True,
                              mlp_only_layers=[0], tie_word_embeddings=False)
    if arch == "mixtral":
        # 4 experts, top 2, on every layer; a window shorter than the prompts
        return MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=12, tie_word_embeddings=True)
    raise ValueError(arch)


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def randomize(model: torch.nn.Module, norm_center: float = 1.0,
              norms: tuple[str, ...] = ("norm",)) -> None:
    """Random weights in place, from torch's current seed. Larger-than-default weights
    give peaked logits (no near-ties for greedy to trip on) and non-zero biases and
    norms, so every loaded tensor matters.

    :param norm_center: the mean of the norms' weights (0 for Gemma's ``(1 + w)``).
    :param norms: name fragments of the parameters that are norm weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(fragment in name for fragment in norms):
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def build_checkpoint(arch: str, directory: Path, seed: int = 0) -> Path:
    """Save a random-weight float32 checkpoint (safetensors + tokenizer) and return it."""
    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def hf_model(path: str | Path, gguf_file: str | None = None) -> torch.nn.Module:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager", **kwargs)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
              eos_ids: frozenset[int] = frozenset()) -> list[int]:
    """Greedy continuation by transformers, one prompt at a time.

    Recomputes the whole sequence each step (no KV cache): slower, but it leaves no
    cache API between the oracle and the truth.
    """
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in eos_ids:
            break
    return ids[len(prompt):]


class SingleRank(Communicator):
    """World size 1: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass
