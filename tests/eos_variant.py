"""A tiny checkpoint made to stop: a copy whose EOS is a token greedy decoding reaches,
with a stop string and a stop token id its greedy outputs hold, so that one workload
exercises every stopping rule (the async-scheduling and speculative-decoding tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from quire import LLM, SamplingParams


def eos_variant(path: Path, prompts: list[list[int]], directory: Path,
                eos_at: int) -> tuple[str, int, str, int]:
    """(the copy's path, its EOS id, a stop string, a stop token id): EOS is the token
    the first prompt's greedy output holds at ``eos_at``; the stop string comes from the
    middle of the fourth prompt's text, the stop id from the third's sixth token."""
    with LLM(str(path), device="cpu", block_size=4) as probe:
        greedy = [o.outputs[0] for o in probe.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    eos = greedy[0].token_ids[eos_at]
    model_dir = directory / "eos"
    shutil.copytree(path, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    text = greedy[3].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "the probe's text has no stop string to pick"
    return str(model_dir), eos, stop, greedy[2].token_ids[5]
