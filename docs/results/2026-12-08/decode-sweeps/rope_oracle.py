"""The tiny Llama preset's file at 600 positions: Quire's greedy logprobs against
transformers float32 and float64 as its GGUF loader gives the model (default rope), and
against transformers given the llama3 rope the file's ``rope_freqs.weight`` holds.

``python rope_oracle.py`` (from the repository root)
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from quire import LLM, SamplingParams
from transformers import AutoConfig, AutoModelForCausalLM

root = Path(__file__).resolve().parents[4]
folder = Path(tempfile.mkdtemp())
path = folder / "tiny.gguf"
subprocess.run([sys.executable, str(root / "scripts" / "make_gguf_model.py"), "--preset",
                "tiny", "--seed", "11", "--output", str(path)], check=True)
prompt = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(5)).tolist()
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=16 << 20) as llm:
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
tokens = out.token_ids
ours = torch.tensor([s[t].logprob for s, t in zip(out.logprobs, tokens)], dtype=torch.float64)
ids = torch.tensor([prompt + tokens])


def logprobs(model):
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
    return logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def load(config=None):
    extra = {} if config is None else {"config": config}
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name,
                                                dtype=torch.float32,
                                                attn_implementation="eager", **extra).eval()


default = load()
f32, f64 = logprobs(default), logprobs(default.double())
config = AutoConfig.from_pretrained(folder, gguf_file=path.name)
config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}
llama3 = logprobs(load(config))
for name, diff in (("Quire - transformers float32, default rope", ours - f32),
                   ("Quire - transformers float64, default rope", ours - f64),
                   ("transformers float32 - float64", f32 - f64),
                   ("Quire - transformers float32, llama3 rope", ours - llama3)):
    print(f"{name}: {diff.abs().max().item():.3g}")
