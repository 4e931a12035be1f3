"""A tiny random-weight LLaVA-NeXT checkpoint with its real processor: CLIP tiles of
30x30 pixels (5x5 patches), any-resolution grids of up to 2x2 tiles."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
)

from tests.tiny_models import VOCAB, _tokenizer, randomize
from tests.tiny_vlm import CHAT_TEMPLATE, IMAGE_TOKEN

#: (height, width) of the tile grids an image may be resized onto.
PINPOINTS = [[30, 60], [60, 30], [60, 60]]


def llava_next_config(image_token_id: int, strategy: str = "default") -> LlavaNextConfig:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, image_size=30, patch_size=6,
                              projection_dim=16)
    text = LlamaConfig(vocab_size=VOCAB + 16, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
    return LlavaNextConfig(vision_config=vision, text_config=text,
                           image_token_index=image_token_id, image_grid_pinpoints=PINPOINTS,
                           vision_feature_select_strategy=strategy, image_seq_length=25)


def build_llava_next(directory: Path, seed: int = 0, strategy: str = "default") -> Path:
    """A float32 LLaVA-NeXT checkpoint, its processor and a chat template, saved."""
    tokenizer = _tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    config = llava_next_config(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), strategy)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    vision = config.vision_config
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": vision.image_size},
        crop_size={"height": vision.image_size, "width": vision.image_size},
        image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   patch_size=vision.patch_size,
                                   vision_feature_select_strategy=strategy,
                                   num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                                   chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
