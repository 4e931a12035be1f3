"""quire.models.gguf_bpe_tables: a converted BPE tokenizer saved as its pipeline and
tables, rebuilt at start without parsing ``tokenizer.json``, and the same tokenizer as
that file's; and the loading plan the conversion records (gguf_hf_cache.LOADING)."""

from __future__ import annotations

import json
import marshal

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
TokenizersBackend = getattr(transformers, "TokenizersBackend", None)
pytestmark = pytest.mark.skipif(TokenizersBackend is None,
                                reason="transformers without TokenizersBackend (< 5)")

from quire.models import gguf_bpe_tables
from quire.models.gguf_bpe_tables import TABLES, load_backend, save_tables
from quire.models.gguf_hf_cache import (
    LOADING,
    cached_tokenizer,
    loading_plan,
    record_added_tokens,
)

from tests.unit.test_gguf_tokenizer_cache import _gemma_vocab, _same_tokenizer, files_json_loads


def _canonical(tokenizer) -> dict:
    return json.loads(tokenizer.to_str())


def _gemma_dir(path):
    """A SentencePiece-style BPE (byte fallback, ``unk``, specials in the vocabulary) as
    transformers saves it."""
    vocab, merges = _gemma_vocab()
    transformers.GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(path)
    return path


def _byte_level_dir(path):
    """A GPT-2-style byte-level BPE with chat specials added after the vocabulary (their
    ids beyond it) and a merge whose parts hold spaces (which ``merges.txt`` could not
    hold): SmolLM2's and Llama 3's shape."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = []
    for left, right in (("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), ("h", "e"), ("he", "l"),
                        ("hel", "l"), ("hell", "o"), ("a b", "c")):
        vocab.setdefault(left, len(vocab))
        vocab.setdefault(right, len(vocab))
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    pipeline = Tokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                             end_of_word_suffix="", fuse_unk=False))
    pipeline.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pipeline.decoder = decoders.ByteLevel()
    pipeline.add_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                         AddedToken("<|im_end|>", special=True, normalized=False),
                         AddedToken("<tool>", special=False, normalized=False)])
    tokenizer = TokenizersBackend(tokenizer_object=pipeline, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("make", [_gemma_dir, _byte_level_dir], ids=["spm-bpe", "byte-level"])
def test_the_tables_rebuild_the_saved_tokenizer(make, tmp_path):
    directory = make(tmp_path)
    saved = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))

    assert save_tables(directory)

    rebuilt = load_backend(directory)
    assert rebuilt is not None and _canonical(rebuilt) == _canonical(saved)
    for text in ("hello the world", "<|im_start|>user\nthe a bc<|im_end|>", "ünï 日本 🤖",
                 "<tool> <unk>"):
        assert rebuilt.encode(text).ids == saved.encode(text).ids, text
    assert rebuilt.get_vocab(with_added_tokens=True) == saved.get_vocab(with_added_tokens=True)


def test_a_start_builds_the_tokenizer_from_the_tables_without_reading_its_json(
        tmp_path, monkeypatch):
    """With the tables saved, the load never opens ``tokenizer.json`` in Rust or Python,
    and gives the tokenizer the JSON load gives: encodings, decodes, specials, settings."""
    directory = _byte_level_dir(tmp_path)
    record_added_tokens(directory)  # as the conversion does, before the tables
    from_json = cached_tokenizer(directory)
    assert save_tables(directory)

    from transformers import tokenization_utils_tokenizers as backend_module

    parsed: list[str] = []
    real = backend_module.TokenizerFast

    class Spy:
        @staticmethod
        def from_file(path, *args, **kwargs):
            parsed.append(str(path))
            return real.from_file(path, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(backend_module, "TokenizerFast", Spy())
    read = files_json_loads(monkeypatch)

    from_tables = cached_tokenizer(directory)

    assert not [name for name in parsed + read if name.endswith("tokenizer.json")], \
        (parsed, read)
    assert type(from_tables) is TokenizersBackend
    _same_tokenizer(from_tables, from_json)
    assert from_tables.added_tokens_decoder == from_json.added_tokens_decoder
    assert from_tables.init_kwargs == from_json.init_kwargs
    assert _canonical(from_tables.backend_tokenizer) == _canonical(from_json.backend_tokenizer)


def test_tables_of_another_tokenizers_version_are_not_read(tmp_path):
    directory = _gemma_dir(tmp_path)
    assert save_tables(directory)
    tables = marshal.loads((directory / TABLES).read_bytes())
    tables["tokenizers"] = "0.0.1"
    (directory / TABLES).write_bytes(marshal.dumps(tables))

    assert load_backend(directory) is None
    assert type(cached_tokenizer(directory)) is TokenizersBackend  # from tokenizer.json


def test_no_tables_for_a_model_that_is_not_bpe(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "##s": 4}
    TokenizersBackend(tokenizer_object=Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
                      ).save_pretrained(tmp_path)

    assert not save_tables(tmp_path)
    assert not (tmp_path / TABLES).exists() and load_backend(tmp_path) is None


def test_no_tables_where_the_rebuilt_tokenizer_would_differ(tmp_path, monkeypatch):
    """The conversion writes tables only after comparing the rebuilt tokenizer with the
    file's: one that differs anywhere (here its normalizer) keeps the JSON path."""
    from tokenizers import normalizers

    rebuild = gguf_bpe_tables._rebuild

    def differs(tables):
        tokenizer = rebuild(tables)
        tokenizer.normalizer = normalizers.Lowercase()
        return tokenizer

    monkeypatch.setattr(gguf_bpe_tables, "_rebuild", differs)
    directory = _gemma_dir(tmp_path)
    assert not save_tables(directory)
    assert not (directory / TABLES).exists()


def test_an_added_token_that_would_get_another_id_refuses_the_tables(tmp_path):
    directory = _byte_level_dir(tmp_path)
    pipeline = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    tables = gguf_bpe_tables._split(pipeline)
    assert gguf_bpe_tables._rebuild(tables) is not None
    tables["added"][0]["id"] += 7  # a gap the added token would not keep

    assert gguf_bpe_tables._rebuild(tables) is None


def test_the_conversion_records_how_a_start_loads_the_tokenizer(tmp_path):
    """GemmaTokenizer only builds its pipeline: the plan loads the generic class with
    Gemma's left padding, and a start follows the recorded plan without looking the
    class up (a plan naming left padding gives it to a tokenizer saved by the generic
    class, whose own default is the right)."""
    gemma = _gemma_dir(tmp_path / "gemma")
    assert loading_plan(gemma) == {
        "class": "GemmaTokenizer", "generic": True,
        "defaults": {"padding_side": "left",
                     "model_input_names": list(transformers.GemmaTokenizer.model_input_names)}}

    generic = _byte_level_dir(tmp_path / "generic")
    assert cached_tokenizer(generic).padding_side == "right"
    plan = loading_plan(generic)
    plan["defaults"] = {"padding_side": "left"}
    (generic / LOADING).write_text(json.dumps(plan), encoding="utf-8")
    assert cached_tokenizer(generic).padding_side == "left"
    (generic / LOADING).write_text("[]", encoding="utf-8")  # not a plan: decided again
    assert cached_tokenizer(generic).padding_side == "right"
