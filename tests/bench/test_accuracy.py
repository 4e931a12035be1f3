"""``quire bench accuracy`` and ``quire.bench.accuracy.compare`` on the tiny model.

Identical configurations give a KL of 0 and full top-1 agreement; bfloat16 against the
float32 reference a small positive KL; the KL and perplexity math against a direct torch
computation; a peer's logits file scored like Quire's; the llama.cpp worker's ``logits``
action against a fake ``llama_cpp``; and the command's one-line errors.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from quire.bench import accuracy
from quire.bench.accuracy import (
    Comparison,
    _Scores,
    compare,
    kl_divergence,
    reference_options,
    run_prompt_logits,
    summarize,
)
from quire.entrypoints.cli import main

import quire.bench.peers.procmem as procmem

#: Small steps, so the text is prefilled in several chunks that read earlier KV pages.
OPTIONS = {"device": "cpu", "max_num_batched_tokens": 48, "kv_cache_memory": 4 << 20}
TOKENS = 160


@pytest.fixture(scope="module")
def same(tiny_path):
    return compare(tiny_path, OPTIONS, max_tokens=TOKENS)


def test_identical_configurations_agree_exactly(same):
    assert same.num_tokens == TOKENS and same.num_positions == TOKENS - 1
    assert same.kl_mean == 0.0 and same.kl_max == 0.0
    assert same.top1_agreement == 1.0
    assert same.ppl_test == same.ppl_ref > 1
    assert same.reference["dtype"] == "float32" == same.test["dtype"]


def test_bfloat16_against_float32_is_close_but_not_equal(tiny_path, same):
    r = compare(tiny_path, {**OPTIONS, "dtype": "bfloat16"}, max_tokens=TOKENS)
    assert r.test["dtype"] == "bfloat16" and r.reference["dtype"] == "float32"
    assert 0 < r.kl_mean < 1e-2 and r.kl_max >= r.kl_p99 >= r.kl_median >= r.kl_min
    assert r.top1_agreement >= 0.9
    assert r.ppl_ref == pytest.approx(same.ppl_ref)  # the same reference, recomputed
    assert r.ppl_test == pytest.approx(r.ppl_ref, rel=0.02)


def test_the_observer_sees_the_logits_the_prompt_logprobs_come_from(tiny_path):
    """EngineCore.prompt_logits_observer: every position once, in several chunks, the
    same rows the engine's own prompt logprobs are taken from."""
    from quire import LLM, SamplingParams

    ids = list(range(3, 3 + 100))
    chunks: list[tuple[int, torch.Tensor]] = []
    with LLM(tiny_path, **OPTIONS) as llm:
        llm.engine.core.prompt_logits_observer = \
            lambda rid, first, logits: chunks.append((first, logits.clone()))
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert [first for first, _ in chunks] == [0, 48, 96]
    rows = torch.cat([logits for _, logits in chunks])
    assert rows.shape[0] == len(ids) - 1 and rows.dtype == torch.float32
    lp = torch.log_softmax(rows, -1)
    for i in (0, 47, 48, 98):
        token = ids[i + 1]
        assert out.prompt_logprobs[i + 1][token].logprob == pytest.approx(
            float(lp[i, token]), abs=1e-5)


def test_the_reference_takes_the_tested_options_with_its_defaults():
    ref = reference_options({"device": "cpu", "dtype": "bfloat16", "quantization": "int8"},
                            {"kv_cache_dtype": "float32"})
    assert ref["device"] == "cpu" and ref["dtype"] == "float32"
    assert ref["kv_cache_dtype"] == "float32"
    if "quantization" in accuracy.engine_fields():
        assert ref["quantization"] == "none"


def test_kl_and_perplexity_match_torch_on_synthetic_logits():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 37, 101
    ref_logits = torch.randn(n, vocab, generator=gen) * 3
    test_logits = ref_logits + 0.3 * torch.randn(n, vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    ref_lp, test_lp = accuracy.log_probs(ref_logits), accuracy.log_probs(test_logits)

    kl = kl_divergence(ref_lp, test_lp)
    expected = torch.nn.functional.kl_div(test_lp.double(), ref_lp.double(), log_target=True,
                                          reduction="none").sum(-1)
    torch.testing.assert_close(kl, expected)
    assert torch.all(kl > 0)
    torch.testing.assert_close(kl_divergence(ref_lp, ref_lp), torch.zeros(n, dtype=torch.float64))

    ref, test = _Scores(n), _Scores(n)
    ref.add(0, ref_lp, targets)
    test.add(0, test_lp[:20], targets[:20], kl[:20])  # in two chunks, as the engine sends
    test.add(20, test_lp[20:], targets[20:], kl[20:])
    r = summarize(ref, test, {}, {})
    assert r.kl_mean == pytest.approx(float(expected.mean()))
    assert r.kl_max == pytest.approx(float(expected.max()))
    assert r.kl_p99 == pytest.approx(float(torch.quantile(expected, 0.99)))
    nll = -torch.log_softmax(test_logits.double(), -1).gather(1, targets[:, None])
    assert r.ppl_test == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    agree = (ref_logits.argmax(-1) == test_logits.argmax(-1)).double().mean()
    assert r.top1_agreement == pytest.approx(float(agree))


def test_a_peer_logits_file_is_scored_like_a_run(tiny_path, tmp_path):
    """The path the llama.cpp peer's logits take, fed Quire's own logits: KL 0."""
    from quire.tokenizer import load_tokenizer

    ids = accuracy.text_token_ids(load_tokenizer(tiny_path), accuracy.load_text(), 64)
    path = tmp_path / "peer.f32"
    with path.open("wb") as out:
        run_prompt_logits(tiny_path, {**OPTIONS, "dtype": "float32"}, ids,
                          lambda first, logits: out.write(logits.numpy().tobytes()))
    with Comparison(tiny_path, ids, reference_options(OPTIONS)) as comparison:
        r = comparison.score_logits_file(path, {"description": "peer"})
    assert r.num_positions == 63 and r.kl_max == 0.0 and r.top1_agreement == 1.0


class FakeLlama:
    """What the worker's ``logits`` action calls; row ``i`` of the logits it returns is
    ``[position, token, 0, ...]``, so the file shows which token sat where."""

    __version__ = "fake"
    VOCAB = 8

    def __init__(self) -> None:
        self.decoded: list[tuple[int, int]] = []

    @staticmethod
    def llama_log_callback(function):
        return function

    def llama_log_set(self, callback, user_data):
        pass

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        return "model"

    def llama_context_default_params(self):
        return SimpleNamespace()

    def llama_init_from_model(self, model, params):
        self.params = params
        return "ctx"

    def llama_model_get_vocab(self, model):
        return "vocab"

    def llama_vocab_n_tokens(self, vocab):
        return self.VOCAB

    def llama_batch_init(self, n, embd, n_seq_max):
        return SimpleNamespace(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                               seq_id=[[0] for _ in range(n)], logits=[0] * n)

    def llama_decode(self, ctx, batch):
        rows = []
        for i in range(batch.n_tokens):
            assert batch.pos[i] == len(self.decoded) and batch.logits[i] == 1
            self.decoded.append((batch.pos[i], batch.token[i]))
            rows.append([batch.pos[i], batch.token[i]] + [0] * (self.VOCAB - 2))
        self.out = (ctypes.c_float * (len(rows) * self.VOCAB))(*sum(rows, []))
        return 0

    def llama_get_logits(self, ctx):
        return self.out

    def llama_model_desc(self, model, buf, size):
        buf.value = b"fake"


def test_the_llamacpp_worker_writes_every_position_once(monkeypatch, tmp_path):
    fake = FakeLlama()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.syspath_prepend(str(Path(procmem.__file__).parent))
    for name in ("llamacpp_worker", "worker_io", "clock", "procmem"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    worker = importlib.import_module("llamacpp_worker")
    ids = [5, 3, 7, 1, 2, 6, 4]
    out = tmp_path / "logits.f32"
    result = worker.logits({"model": "m.gguf", "token_ids": ids, "output": str(out),
                            "options": {"n_batch": 4, "kv_type": "f32"}})
    sys.modules.pop("llamacpp_worker", None)
    rows = np.fromfile(out, dtype="<f4").reshape(len(ids) - 1, FakeLlama.VOCAB)
    assert rows[:, 0].tolist() == list(range(len(ids) - 1))  # positions 0 .. n-2
    assert rows[:, 1].tolist() == ids[:-1]  # our token ids, as given
    assert result["rows"] == len(ids) - 1 and result["n_vocab"] == FakeLlama.VOCAB
    assert fake.params.type_k == 0 and "F32 KV cache" in result["engine"]


# -- the command ---------------------------------------------------------------------------
SMALL = ["--device", "cpu", "--max-num-batched-tokens", "48", "--kv-cache-memory", "4MiB"]


def test_the_command_prints_the_table_and_writes_the_json(capsys, tmp_path, tiny_path):
    out = tmp_path / "accuracy.json"
    assert main(["bench", "accuracy", "--model", tiny_path, *SMALL, "--dtype", "bfloat16",
                 "--max-tokens", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean KL(ref || test)" in text and "top-1 agreement" in text
    assert "llama.cpp peer: not run (the model is not a GGUF file)" in text
    record = json.loads(out.read_text())
    figures = record["results"]["quire"]["figures"]
    assert figures["num_positions"] == 63 and figures["kl_mean"] > 0
    assert record["settings"]["tested_options"]["dtype"] == "bfloat16"
    assert record["settings"]["reference_options"]["dtype"] == "float32"
    assert record["results"]["quire"]["reference"]["dtype"] == "float32"


@pytest.mark.parametrize("extra, message", [
    (["--text", "/no/such/file.txt"], "--text: /no/such/file.txt: no such file"),
    (["--max-tokens", "1"], "--max-tokens: must be >= 2"),
    (["--ref-option", "no_such_option=1"], "--ref-option: unknown engine option"),
    (["--ref-option", "block_size=many"], "--ref-option block_size:"),
    (["--ref-dtype", "float64"], "--ref-dtype:"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, tiny_path, extra, message):
    assert main(["bench", "accuracy", "--model", tiny_path, *SMALL, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quire bench accuracy: error: ") and message in err
    assert len(err.splitlines()) == 1


def test_an_empty_or_one_token_text_is_refused(capsys, tmp_path, tiny_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    assert main(["bench", "accuracy", "--model", tiny_path, *SMALL, "--text", str(empty)]) == 2
    assert f"--text: {empty} is empty" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("a", encoding="utf-8")  # one token for the tiny tokenizer (no BOS)
    assert main(["bench", "accuracy", "--model", tiny_path, *SMALL, "--text", str(short)]) == 2
    assert "--text: the text is 1 token(s); at least 2 are needed" in capsys.readouterr().err
