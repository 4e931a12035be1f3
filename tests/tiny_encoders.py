"""Tiny random BERT checkpoints saved as sentence-transformers directories, and the
transformers oracle of their embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_models import VOCAB, _tokenizer
from transformers import AutoModel, BertConfig, BertModel

#: sentence-transformers' flag for each of our pooling methods.
_ST_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
             "last": "pooling_mode_lasttoken"}


def build_bert(directory: Path, pooling: str | None = "mean", normalize: bool = True,
               seed: int = 0) -> Path:
    """A two-layer BERT with a byte-level BPE tokenizer; with ``pooling``, saved as a
    sentence-transformers directory (``modules.json``, ``1_Pooling``, and
    ``Normalize`` when ``normalize``), else as a bare Hugging Face checkpoint."""
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=128, architectures=["BertModel"])
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    if pooling is None:
        return directory
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    flags = {flag: flag == _ST_FLAGS[pooling] for flag in _ST_FLAGS.values()}
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags}))
    return directory


def hf_embeddings(path: str | Path, prompts: list[list[int]], pooling: str,
                  normalize: bool) -> torch.Tensor:
    """float32 [N, hidden]: transformers' last hidden states of each prompt alone,
    pooled (mean, cls or last) and optionally L2-normalised."""
    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            rows.append({"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling])
    out = torch.stack(rows)
    return F.normalize(out, dim=-1) if normalize else out
