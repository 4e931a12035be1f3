"""quire.models.gguf_hf_cache.cached_tokenizer: a saved tokenizer whose class only builds
its pipeline loads as the generic fast tokenizer over its ``tokenizer.json``, the same
tokenizer without the class's Python copy of the vocabulary and merges; a class with
methods of its own keeps its class."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
TokenizersBackend = getattr(transformers, "TokenizersBackend", None)
pytestmark = pytest.mark.skipif(TokenizersBackend is None,
                                reason="transformers without TokenizersBackend (< 5)")

from quire.models.gguf_hf_cache import _builds_pipeline_only, cached_tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
WORDS = ("the", "then", "there", "hello", "world")
TEXTS = ("hello world", " then there", "  then there\tthe\n", "<bos>the <eos> end", "ünï 日本 🤖", "", " ")


def _gemma_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small SentencePiece-style BPE: specials, byte fallbacks, letters, and merges up
    to a few whole words (each merge's result in the vocabulary)."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        left = "▁"
        for ch in word:
            merged = left + ch
            if merged not in tokens:
                tokens.append(merged)
                merges.append((left, ch))
            left = merged
    return {t: i for i, t in enumerate(tokens)}, merges


def _same_tokenizer(a, b) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert a.encode(text, add_special_tokens=special) == \
                b.encode(text, add_special_tokens=special), (text, special)
    ids = list(range(len(a)))
    assert a.decode(ids) == b.decode(ids)
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert a.get_vocab() == b.get_vocab() and len(a) == len(b)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "padding_side", "model_input_names"):
        assert getattr(a, name) == getattr(b, name), name


def files_json_loads(monkeypatch) -> list[str]:
    """The names of the files ``json.load`` reads from now on (the list fills as it
    runs)."""
    import json

    parsed: list[str] = []
    load = json.load

    def spy(handle, *args, **kwargs):
        parsed.append(getattr(handle, "name", "?"))
        return load(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", spy)
    return parsed


def test_a_pipeline_only_class_loads_as_the_generic_tokenizer(tmp_path):
    vocab, merges = _gemma_vocab()
    transformers.GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    by_class = transformers.GemmaTokenizer.from_pretrained(tmp_path)
    assert len(by_class._merges) == len(merges)  # what the generic load does not keep

    loaded = cached_tokenizer(tmp_path)

    assert type(loaded) is TokenizersBackend
    assert not hasattr(loaded, "_merges") and not hasattr(loaded, "_vocab")
    _same_tokenizer(loaded, by_class)
    # the merges apply (no prefix space is added: the words' own spaces carry the ▁)
    assert loaded.encode(" then there", add_special_tokens=False) == [
        vocab["▁then"], vocab["▁there"]]


def test_a_class_with_methods_of_its_own_keeps_its_class(tmp_path):
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4}
    transformers.CodeGenTokenizer(vocab=vocab, merges=[("a", "b")]).save_pretrained(tmp_path)

    loaded = cached_tokenizer(tmp_path)

    assert type(loaded) is transformers.CodeGenTokenizer  # it overrides decode


def test_what_counts_as_building_the_pipeline_only():
    class OnlyInit(TokenizersBackend):
        padding_side = "left"

        def __init__(self, **kwargs):
            super().__init__(**kwargs)

    class WithMethod(OnlyInit):
        def decode(self, *args, **kwargs):
            return ""

    class WithProperty(TokenizersBackend):
        @property
        def extra(self):
            return 1

    assert _builds_pipeline_only(TokenizersBackend, TokenizersBackend)
    assert _builds_pipeline_only(OnlyInit, TokenizersBackend)
    assert not _builds_pipeline_only(WithMethod, TokenizersBackend)
    assert not _builds_pipeline_only(WithProperty, TokenizersBackend)
    assert not _builds_pipeline_only(transformers.PreTrainedTokenizerBase, TokenizersBackend)


def test_the_saved_settings_win_over_the_class_defaults(tmp_path):
    """GemmaTokenizer pads on the left by default; a saved ``padding_side`` is kept."""
    vocab, merges = _gemma_vocab()
    transformers.GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    assert cached_tokenizer(tmp_path).padding_side == \
        transformers.GemmaTokenizer.padding_side == "left"
    transformers.GemmaTokenizer(vocab=vocab, merges=merges,
                                padding_side="right").save_pretrained(tmp_path)
    loaded = cached_tokenizer(tmp_path)
    assert type(loaded) is TokenizersBackend
    assert loaded.padding_side == "right"
    assert transformers.GemmaTokenizer.from_pretrained(tmp_path).padding_side == "right"


def test_added_tokens_are_recorded_so_a_load_skips_parsing_tokenizer_json(tmp_path,
                                                                          monkeypatch):
    """transformers 5 saves no ``added_tokens_decoder``, and then each load parses the
    whole ``tokenizer.json`` in Python to find them; once recorded, a load reads only the
    small settings file in Python and gives the same tokenizer."""
    import json

    from quire.models.gguf_hf_cache import record_added_tokens

    vocab, merges = _gemma_vocab()
    transformers.GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "added_tokens_decoder" not in settings  # else this test shows nothing
    before = cached_tokenizer(tmp_path)

    record_added_tokens(tmp_path)

    settings = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    pipeline = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert settings["added_tokens_decoder"] == {
        str(t["id"]): {k: v for k, v in t.items() if k != "id"}
        for t in pipeline["added_tokens"]}
    parsed = files_json_loads(monkeypatch)
    after = cached_tokenizer(tmp_path)
    assert parsed and not [name for name in parsed if name.endswith("tokenizer.json")]
    _same_tokenizer(after, before)
    assert after.added_tokens_decoder == before.added_tokens_decoder
    record_added_tokens(tmp_path)  # already there: left as it is
    assert json.loads((tmp_path / "tokenizer_config.json").read_text(
        encoding="utf-8")) == settings
