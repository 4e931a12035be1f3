"""A tiny random Gemma 3 image-text checkpoint (SigLIP tower, pooled projector, Gemma 3
text decoder with a sliding layer) and its real processor."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from tests.tiny_models import _tokenizer, randomize

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
#: Image tokens per image: a 4 x 4 pooled grid.
TOKENS = 16


def build_gemma3_vlm(directory: Path, seed: int = 0, sliding_window: int = 8) -> Path:
    """A float32 checkpoint whose sliding window (``sliding_window``) is shorter than an
    image, so the bidirectional image mask meets the window."""
    # Gemma 3's processor reads the image markers as the tokenizer's named tokens
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer().backend_tokenizer, bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI})
    boi, image_id, eoi = tokenizer.boi_token_id, tokenizer.image_token_id, \
        tokenizer.eoi_token_id
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=4,
                                vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=len(tokenizer) + 13, hidden_size=64,
                            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, sliding_window=sliding_window,
                            query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=512, final_logit_softcapping=10.0)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS,
                          image_token_index=image_id, boi_token_index=boi,
                          eoi_token_index=eoi)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    randomize(model, norm_center=0.0)  # Gemma's norms scale by (1 + w)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer, image_seq_length=TOKENS)
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
