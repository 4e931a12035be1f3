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


def _tokenizers(sentencepiece: bool = False):
    yield "tiny", _tokenizer()
    try:
        from quire.config import EngineConfig
        from quire.model_store import model_path_of
        from quire.tokenizer import load_tokenizer

        yield "smollm2", load_tokenizer(model_path_of(EngineConfig(
            model="SmolLM2-135M-Instruct")))
    except Exception:  # not on this host: the tiny one still runs
        pass
    if sentencepiece:  # Gemma 3's (a SentencePiece vocabulary, byte fallback), if cached
        from quire.model_store import cached_models
        from quire.tokenizer import load_tokenizer

        for path in cached_models():
            if path.name.startswith("gemma-3"):
                yield "gemma3", load_tokenizer(str(path))
                break


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


def _two_decodes(tok) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok)
    detok._stream_type = None
    return detok


def _sequences(tok, rng: random.Random, count: int):
    """Prompts and outputs: random ids (partial characters, specials) and real text."""
    specials = list(tok.all_special_ids)[:50]
    pool = range(len(tok))
    text = ("Héllo wörld! 日本語のテキスト 🙂🙃 and some   spaced  words,\nnew lines; "
            "ÆØÅ æøå — “quotes” ")
    ids = tok(text * 4, add_special_tokens=False)["input_ids"]
    for i in range(count):
        if i % 2:  # real text, cut anywhere, a special now and then
            start = rng.randrange(len(ids) - 40)
            prompt = ids[start : start + rng.randrange(1, 9)]
            outputs = [rng.choice(specials) if rng.random() < 0.05 else t
                       for t in ids[start + len(prompt) : start + len(prompt) + 30]]
        else:
            prompt = [rng.choice(pool) for _ in range(rng.randrange(1, 8))]
            outputs = [rng.choice(specials) if rng.random() < 0.1 else rng.choice(pool)
                       for _ in range(30)]
        yield prompt, outputs


@pytest.mark.slow  # about 45 s on 2 cores, nearly all of it with skip_special=True
@pytest.mark.parametrize("skip_special", [True, False])
def test_the_decode_stream_streams_what_two_decodes_do(skip_special):
    """One ``DecodeStream.step`` per token where it applies, two decodes elsewhere: the
    same deltas as two decodes per token, and as transformers' own decode, on random and
    real-text sequences of several tokenizers."""
    for name, tok in _tokenizers(sentencepiece=True):
        streamed = IncrementalDetokenizer(tok)
        if streamed._stream_type is None:
            pytest.skip("this tokenizers has no DecodeStream that starts from ids")
        by_stream = [0]
        stream_step = streamed._stream_step

        def counted(*args, stream_step=stream_step, by_stream=by_stream):
            text = stream_step(*args)
            by_stream[0] += bool(text)
            return text

        streamed._stream_step = counted
        two, slow = _two_decodes(tok), IncrementalDetokenizer(tok)
        slow._backend_decode = None
        rng = random.Random(1)
        decode = {"skip_special_tokens": skip_special}
        for prompt, outputs in _sequences(tok, rng, 200):
            want = _stream(two, prompt, outputs, **decode)
            assert _stream(streamed, prompt, outputs, **decode) == want, (name, prompt,
                                                                            outputs)
            assert _stream(slow, prompt, outputs, **decode) == want, name
        assert by_stream[0] > 500, (name, by_stream)  # of 6000 tokens: the stream ran


def test_the_decode_stream_carries_plain_text():
    """On plain text the stream takes every token (else the test above proves little)."""
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok)
    if detok._stream_type is None:
        pytest.skip("this tokenizers has no DecodeStream that starts from ids")
    ids = tok("the quick brown fox jumps over the lazy dog " * 3)["input_ids"]
    state, seq = detok.start(4), list(ids[:4])
    text = ""
    for token in ids[4:]:
        seq.append(token)
        text += detok.step(state, seq)
        assert state.stream is not None
    text += detok.flush(state, seq)
    assert text == "".join(_stream(_two_decodes(tok), ids[:4], ids[4:]))
    assert text == tok.decode(ids)[len(tok.decode(ids[:4])):]
