"""A tiny random-weight Idefics3 (SmolVLM) checkpoint with its real processor: SigLIP
tiles of 24x24 pixels (6x6 patches, 9 embeddings after the 2x pixel shuffle), images
resized to a longest edge of 48 and so split into up to 2x2 tiles plus a global one."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlamaConfig,
)

from tests.tiny_models import VOCAB, _tokenizer, randomize
from tests.tiny_vlm import CHAT_TEMPLATE

#: Tile side in pixels, and the longest edge an image is resized to before tiling.
TILE, LONGEST = 24, 48
#: Embeddings (``<image>`` tokens) per tile: (24 / 4)^2 patches over a 2x2 shuffle.
TILE_EMBEDS = 9

#: The tokens the processor's prompt expansion writes, added to the tiny tokenizer.
SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                   "<global-img>"]
                  + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def idefics3_config(image_token_id: int) -> Idefics3Config:
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=TILE, patch_size=4)
    text = LlamaConfig(vocab_size=VOCAB + 48, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
    return Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                          image_token_id=image_token_id, tie_word_embeddings=False)


def build_idefics3(directory: Path, seed: int = 0) -> Path:
    """A float32 Idefics3 checkpoint, its processor and a chat template, saved."""
    tokenizer = _tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    config = idefics3_config(tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": LONGEST},
                                             max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=TILE_EMBEDS, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
