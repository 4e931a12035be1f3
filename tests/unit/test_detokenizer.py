"""The detokenizer's fast path (the tokenizers library's own decode) streams exactly the
text transformers' decode does, and is taken only where the two are the same."""

from __future__ import annotations

import random

import pytest
from quire.engine.detokenizer import IncrementalDetokenizer, backend_decode
from tiny_models import _tokenizer


def _stream(detok: IncrementalDetokenizer, prompt: list[int], outputs: list[int],
            **decode: bool) -> list[str]:
    state, ids, deltas = detok.start(len(prompt)), list(prompt), []
    for token in outputs:
        ids.append(token)
        deltas.append(detok.step(state, ids, **decode))
    deltas.append(detok.flush(state, ids, **decode))
    return deltas


def _tokenizers():
    yield "tiny", _tokenizer()
    try:
        from quire.config import EngineConfig
        from quire.model_store import model_path_of
        from quire.tokenizer import load_tokenizer

        yield "smollm2", load_tokenizer(model_path_of(EngineConfig(
            model="SmolLM2-135M-Instruct")))
    except Exception:  # not on this host: the tiny one still runs
        pass


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_the_fast_path_streams_what_transformers_decode_does(skip_special, spaces):
    for name, tok in _tokenizers():
        fast = IncrementalDetokenizer(tok)
        assert fast._backend_decode is not None, name
        slow = IncrementalDetokenizer(tok)
        slow._backend_decode = None
        rng = random.Random(0)
        specials = list(tok.all_special_ids)
        for _ in range(20):
            pool = range(min(len(tok), 4000))
            prompt = [rng.choice(pool) for _ in range(rng.randrange(1, 8))]
            outputs = [rng.choice(specials) if rng.random() < 0.1 else rng.choice(pool)
                       for _ in range(30)]
            decode = {"skip_special_tokens": skip_special,
                      "spaces_between_special_tokens": spaces}
            assert (_stream(fast, prompt, outputs, **decode)
                    == _stream(slow, prompt, outputs, **decode)), name


def test_no_fast_path_where_transformers_does_more_than_decode():
    tok = _tokenizer()
    tok.clean_up_tokenization_spaces = True
    assert backend_decode(tok) is None

    class Own(type(_tokenizer())):
        def _decode(self, token_ids, **kwargs):
            return "!" + super()._decode(token_ids, **kwargs)

    own = _tokenizer()
    own.__class__ = Own
    assert backend_decode(own) is None
    assert backend_decode(_tokenizer()) is not None
