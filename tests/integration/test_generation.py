"""Generation semantics through the engine: n samples on shared pages, seeds, stop
strings, streaming, logprobs against transformers, min_tokens, chat errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quire import LLM, SamplingParams
from tiny_models import ARCHS, hf_greedy, hf_model

PROMPT = "Once upon a time there was a quiet village by the sea, where the fishermen told"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), device="cpu", block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)
    return path, llm, ids


def test_n_samples_share_the_prompt_pages(llama):
    _, llm, ids = llama
    engine, bm = llm.engine, llm.engine.core.block_manager
    assert len(ids) % 4 != 0  # a partial last page, which each sample recomputes
    shared = (len(ids) - 1) // 4
    rid = engine.add_request(ids, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6,
                                                 ignore_eos=True))
    engine.step()  # the parent's prefill; the three other samples are forked
    parent = engine.core._requests[rid].seqs[0]
    engine.step()  # children admitted: they compute only the prompt's tail
    seqs = engine.core._requests[rid].seqs
    assert [s.index for s in seqs] == [0, 1, 2, 3]
    for page in parent.block_table[:shared]:
        assert bm.ref_count(page) == 4
    for child in seqs[1:]:
        assert child.block_table[:shared] == parent.block_table[:shared]
        assert child.num_cached_tokens == 0  # shared by fork, not found in the cache
    own = {p for s in seqs for p in s.block_table[shared:]}
    assert bm.num_used_blocks == shared + len(own)
    bm.check_invariants(engine.core.scheduler.live_sequences())
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    [out] = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
    assert bm.num_used_blocks == 0


def test_n_samples_are_reproducible_with_a_seed(llama):
    _, llm, ids = llama
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    first = llm.generate(ids, params)[0]
    second = llm.generate(ids, params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]


def test_a_seeded_request_is_the_same_alone_and_in_a_crowd(llama):
    _, llm, ids = llama
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12,
                            ignore_eos=True)
    [alone] = llm.generate(ids, target)
    crowd_params = [SamplingParams(temperature=t, top_k=k, max_tokens=5 + i, ignore_eos=True,
                                   seed=None if i % 2 else i)
                    for i, (t, k) in enumerate([(0.5, 5), (1.3, -1), (0.0, -1), (0.9, 20)] * 4)]
    prompts = [ids[: 3 + i] for i in range(16)] + [ids]
    outs = llm.generate(prompts, crowd_params + [target])
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def _greedy_text(llm, ids, n=16):
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out


def test_stop_string_across_token_boundaries(llama):
    _, llm, ids = llama
    tok = llm.get_tokenizer()
    full = _greedy_text(llm, ids)
    pieces = [tok.decode(full.outputs[0].token_ids[: i + 1]) for i in range(16)]
    # a stop string made of the end of token k's text and the start of token k+1's
    k = next(i for i in range(3, 14) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    boundary = len(pieces[k])
    stop = pieces[k + 1][boundary - 2 : boundary + 2]
    cut = full.outputs[0].text.find(stop)
    assert cut != -1
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                             stop=[stop, "never-seen-xyz"]))
    c = out.outputs[0]
    assert c.text == full.outputs[0].text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full.outputs[0].token_ids[: k + 2]
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                             stop=stop, include_stop_str_in_output=True))
    assert out.outputs[0].text == full.outputs[0].text[: cut + len(stop)]


def test_streamed_text_grows_monotonically_to_the_final_text(llama):
    _, llm, ids = llama
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["zzz-qq"])
    [final] = llm.generate(ids, params)
    texts, finished = [], []
    for out in llm.stream(ids, params):
        texts.append(out.outputs[0].text)
        finished.append(out.finished)
    assert finished[-1] and not any(finished[:-1])
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
    assert texts[-1] == final.outputs[0].text
    # while running, the tail that could begin the 6-character stop string is withheld
    assert len(texts[-2]) <= len(final.outputs[0].text) - 5 or len(texts[-2]) == 0


def test_leaving_a_stream_early_aborts_and_frees_pages(llama):
    _, llm, ids = llama
    for out in llm.stream(ids, SamplingParams(max_tokens=50, ignore_eos=True)):
        break
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_agree_with_transformers(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    llm = LLM(str(path), device="cpu", block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)
    model = hf_model(path)
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             logprobs=3, prompt_logprobs=2))
    gen = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + gen])).logits[0].double(), -1)
    # generated tokens: position len(ids)-1+i predicts gen[i]
    worst = 0.0
    for i, (token, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        assert entry[token].rank == 1  # greedy picks the top token
        top = torch.topk(row, 3)
        assert list(entry)[:3] == top.indices.tolist() or token in top.indices.tolist()
        for tid, lp in entry.items():
            worst = max(worst, abs(lp.logprob - float(row[tid])))
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(gen)), abs=1e-3)
    # prompt tokens: position p predicts ids[p+1]; the first has nothing before it
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert ids[p] in entry and len(entry) in (2, 3)
        for tid, lp in entry.items():
            worst = max(worst, abs(lp.logprob - float(ref[p - 1, tid])))
        rank = int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert entry[ids[p]].rank == rank
    assert worst < 1e-3


def test_prompt_logprobs_survive_chunked_prefill(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", max_num_batched_tokens=5)
    ids = llm.get_tokenizer().encode(PROMPT)
    [chunked] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    [whole] = LLM(str(tiny_checkpoint("llama")), device="cpu").generate(
        ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert len(chunked.prompt_logprobs) == len(ids)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)


def test_min_tokens_holds_back_eos(llama, tmp_path):
    path, _, ids = llama
    expected = hf_greedy(hf_model(path), ids, 12)
    eos = expected[1]
    model_dir = tmp_path / "eos"
    shutil.copytree(path, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = LLM(str(model_dir), device="cpu")
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))
    assert out.outputs[0].token_ids == expected[:2]
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, min_tokens=6))
    assert len(out.outputs[0].token_ids) >= 6
    assert eos not in out.outputs[0].token_ids[:6]


def test_logprobs_above_the_engine_maximum_are_refused(llama):
    _, llm, ids = llama
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(ids, SamplingParams(logprobs=21))
    assert not llm.engine.has_unfinished_requests()


def test_progress_bar_does_not_change_results(llama, capsys):
    _, llm, ids = llama
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate([ids, ids[:5]], params)
    shown = llm.generate([ids, ids[:5]], params, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in plain]
    assert "requests" in capsys.readouterr().err


def test_chat_without_a_template_names_the_option(llama):
    _, llm, _ = llama
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    [out] = llm.chat([{"role": "user", "content": "Once upon a time"}],
                     SamplingParams(temperature=0, max_tokens=3), chat_template=template)
    assert out.prompt == "Once upon a time\n"
    assert len(out.outputs[0].token_ids) <= 3
