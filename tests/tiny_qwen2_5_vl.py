"""A tiny random-weight Qwen2.5-VL checkpoint with its image processor and tokenizer
saved (they reload as Quire's front builds its processor), and transformers' greedy
continuation given the same images."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from tests.tiny_models import VOCAB, _tokenizer, randomize

#: What a prompt says where an image goes.
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PATCH = 4
MERGE = 2

#: Walks content parts and prints the placeholder for an image, as Qwen's template does.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def qwen2_5_vl_config(vision_start: int, image_pad: int, vision_end: int
                      ) -> Qwen2_5_VLConfig:
    """Windows of 2x2 merged blocks (16 pixels a side) on layers 0 and 2, whole images
    on 1 and 3; the text's 8 frequencies split 2/3/3 over time, height, width."""
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
              "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2,
              "window_size": 16, "out_hidden_size": 64, "fullatt_block_indexes": [1, 3]}
    text = {"vocab_size": VOCAB + 16, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]}}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=image_pad,
                            vision_start_token_id=vision_start, vision_end_token_id=vision_end,
                            video_token_id=VOCAB + 15, tie_word_embeddings=False)


def build_qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    """A float32 checkpoint, its image processor (8x8 to 40x40 pixels after resizing)
    and tokenizer with a chat template, saved."""
    tokenizer = _tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    config = qwen2_5_vl_config(*tokenizer.convert_tokens_to_ids(SPECIAL))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    randomize(model, norms=("norm", "ln_q"))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                             min_pixels=8 * 8, max_pixels=40 * 40).save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def hf_qwen2_5_vl(path: Path) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, processor, prompt: str, images: list,
              max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' ``generate`` (its M-RoPE positions for the
    prompt, then the prompt's shift for each new token)."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens)
    return out[0, n:].tolist()
