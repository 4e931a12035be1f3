"""The drafts of the runs here, for SmolLM2-135M-Instruct (Q4_1 GGUF, the built-in model):

- ``smollm2-first24``: its first 24 of 30 decoder layers, with its embeddings, final norm
  and head (an untrained early exit), dequantised to float32;
- ``tiny-random``: a 2-layer random llama with SmolLM2's vocabulary and tokenizer.

    python make_drafts.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from quire.model_store import BUILTIN_MODELS, fetch
from quire.models.gguf_hf_cache import hf_dir_for_gguf

out = Path(sys.argv[1])
gguf = fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"])
tokenizer = AutoTokenizer.from_pretrained(hf_dir_for_gguf(str(gguf)))

model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                             dtype=torch.float32)
config = model.config
config.num_hidden_layers = 24
if hasattr(config, "quantization_config"):
    del config.quantization_config
early = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
early.load_state_dict(model.state_dict(), strict=False)  # layers 24..29 are left out
early.save_pretrained(out / "smollm2-first24")
tokenizer.save_pretrained(out / "smollm2-first24")

vocab = json.loads((hf_dir_for_gguf(str(gguf)) / "config.json").read_text())["vocab_size"]
torch.manual_seed(0)
tiny = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    tie_word_embeddings=True))
tiny.save_pretrained(out / "tiny-random")
tokenizer.save_pretrained(out / "tiny-random")
