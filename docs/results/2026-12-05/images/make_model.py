"""Write a LLaVA-shaped random-weight checkpoint of realistic size for a 2-core host.

A CLIP ViT-B/16-like vision tower at 224 px (hidden 768, 12 layers, 12 heads, patch 16:
196 image tokens, the class token dropped), LLaVA-1.5's two-layer GELU projector, and a
SmolLM2-135M-shaped Llama decoder (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49152 plus 64 rows, the first of them ``<image>``), float32,
untied head (as LLaVA-1.5's decoders). Weights are transformers' own random init, seeded.

The processor (``LlavaProcessor``: ``CLIPImageProcessor`` at 224 and the tokenizer) is
saved beside it. The tokenizer is ``--tokenizer DIR``'s (SmolLM2's, from the peers'
converted checkpoint) when given, else a small byte-level BPE trained here as
tests/tiny_models.py does. Usage: ``python make_model.py OUT [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

IMAGE_TOKEN = "<image>"
VOCAB = 49152
IMAGE_SIZE, PATCH = 224, 16
# CLIP's normalisation, as openai/clip-vit-base-patch16's processor has it
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_CORPUS = ("The capital of France is Paris. A photograph shows a quiet village by the "
           "sea, boats on the sand and nets drying in the sun. ") * 64


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of a few hundred tokens (no better tokenizer given)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def config(image_token_id: int, bos: int, eos: int, pad: int) -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, image_size=IMAGE_SIZE,
                              patch_size=PATCH, projection_dim=512, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=VOCAB + 64, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, rope_theta=100000.0,
                       rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos,
                       pad_token_id=pad, tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text,
                       image_token_index=image_token_id,
                       image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
                       vision_feature_select_strategy="default", vision_feature_layer=-2,
                       projector_hidden_act="gelu", tie_word_embeddings=False)


def llava_hf_names(path: Path) -> None:
    """Rename the vision tower's tensors to the llava-hf checkpoints' names
    (``vision_tower.vision_model.*``): transformers 5.25 writes ``vision_tower.*``, which
    vLLM 0.32's loader does not know; every loader here reads the llava-hf names."""
    tensors = load_file(path)
    renamed = {("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
                else k): v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def build(out: Path, tokenizer_dir: str | None, seed: int = 0) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir \
        else bpe_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_token_id >= VOCAB + 64:
        raise SystemExit(f"{IMAGE_TOKEN} got id {image_token_id}, past the vocabulary")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    cfg = config(image_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, pad)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    llava_hf_names(out / "model.safetensors")
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token=IMAGE_TOKEN)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e6:.1f}M parameters, {IMAGE_TOKEN} = {image_token_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the checkpoint directory to write")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a tokenizer directory (default: a small BPE trained here)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, args.tokenizer, args.seed)


if __name__ == "__main__":
    main()
