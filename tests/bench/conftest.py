"""Fixtures of the benchmark tests: the tiny checkpoint's tokenizer and its corpus."""

from __future__ import annotations

import pytest
from quire.bench.corpus import Corpus, TokenizerSource
from quire.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def tiny_corpus(tiny_tokenizer):
    return Corpus(TokenizerSource(tiny_tokenizer, "tiny"))
