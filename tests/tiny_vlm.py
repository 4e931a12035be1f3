"""Tiny random-weight image-text checkpoints (LLaVA) with their real processors, and the
transformers oracle given the same images."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from tests.tiny_models import VOCAB, _tokenizer, randomize

#: The placeholder token, added to the tiny tokenizer (its id: the next free one).
IMAGE_TOKEN = "<image>"

#: A chat template that walks content parts and prints the placeholder for an image.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def llava_config(image_token_id: int, image_size: int = 30, patch: int = 6) -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, image_size=image_size, patch_size=patch,
                              projection_dim=16)
    text = LlamaConfig(vocab_size=VOCAB + 16, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text,
                       image_token_index=image_token_id,
                       image_seq_length=(image_size // patch) ** 2)


def build_llava(directory: Path, seed: int = 0) -> Path:
    """A float32 LLaVA checkpoint, its processor and a chat template, saved."""
    tokenizer = _tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    config = llava_config(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    vision = config.vision_config
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": vision.image_size},
        crop_size={"height": vision.image_size, "width": vision.image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=vision.patch_size,
                               vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def image(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB image."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def hf_vlm(path: Path) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_vlm_greedy(model: torch.nn.Module, processor, prompt: str, images: list,
                  max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
    """Greedy continuation by transformers given ``images``, the whole sequence each step."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt",
                       add_special_tokens=add_special_tokens)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, **inputs).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if "token_type_ids" in inputs:  # Gemma 3: which tokens are images'
            inputs["token_type_ids"] = torch.cat(
                [inputs["token_type_ids"], torch.zeros((1, 1), dtype=torch.long)], dim=1)
    return out
