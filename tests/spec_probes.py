"""What speculation tests watch inside the engine's core: every verification's drafts, and
how many asynchronous steps ran. Shared by the draft-model, EAGLE and MTP tests."""

from __future__ import annotations


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every verification's (context, drafts), as the engine's core runs them."""
    from quire.engine.core import EngineCore

    seen: list[tuple[list[int], list[int]]] = []
    verify = EngineCore._verify

    def recording(self, seqs, logits, drafts, outputs):
        for seq, draft in zip(seqs, drafts):
            seen.append((list(seq.prompt_token_ids) + list(seq.output_token_ids), draft))
        return verify(self, seqs, logits, drafts, outputs)

    monkeypatch.setattr(EngineCore, "_verify", recording)
    return seen


def count_async_steps(monkeypatch) -> list[int]:
    """A list that grows by one at every asynchronous step of the engine's core."""
    from quire.engine.core import EngineCore

    steps: list[int] = []
    step_async = EngineCore._step_async

    def counting(self):
        steps.append(1)
        return step_async(self)

    monkeypatch.setattr(EngineCore, "_step_async", counting)
    return steps
