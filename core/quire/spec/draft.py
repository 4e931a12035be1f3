"""Checks of a draft model against its target, made once at start (by the engine core,
before any worker loads the draft): proposals are token ids, so the two must share
the vocabulary, id for id."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from quire.model_store import resolve_model
from quire.models.loader import load_model_config
from quire.spec.config import SpeculativeConfig
from quire.tokenizer import load_tokenizer


def check_draft(spec: SpeculativeConfig, vocab_size: int,
                tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a draft model whose vocabulary differs from the target's: by size (the
    configs'), and id by id where the draft comes with a tokenizer of its own (one
    without only has its size checked).

    :raises ValueError: one line naming ``speculative_config.model``.
    """
    assert spec.model is not None
    try:
        path = resolve_model(spec.model)
        config = load_model_config(path)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise ValueError(f"speculative_config.model {spec.model!r}: {exc}") from None
    draft_size = getattr(config, "vocab_size", None)
    if draft_size != vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                         f"{draft_size} tokens, the target's has {vocab_size}: a draft "
                         "must share the target's tokenizer")
    try:
        draft_tokenizer = load_tokenizer(path)
    except ValueError:
        return  # no tokenizer of its own: the size is all there is to check
    ours = {i: t for t, i in tokenizer.get_vocab().items()}
    theirs = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    # ids only one side names (a special token one of them adds) carry no text to differ
    differ = sorted(i for i in ours.keys() & theirs.keys() if ours[i] != theirs[i])
    if differ:
        index = differ[0]
        raise ValueError(f"speculative_config.model {spec.model!r} has another tokenizer "
                         f"than the target's (first difference: id {index} is "
                         f"{theirs[index]!r}, the target's {ours[index]!r}): a draft must "
                         "share the target's tokenizer")
