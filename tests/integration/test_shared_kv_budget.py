"""Two models' engines under one KV budget (the ledger of ``quire.engine.kv_budget``):
each one's greedy output equals its output alone, the budget is never exceeded, and an
idle model's cached pages go to the busy one, then come back when it is busy again."""

from __future__ import annotations

import pytest
from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.engine.core import EngineCore
from quire.engine.core_client import InprocCoreClient
from quire.engine.kv_budget import KVLedger, KVShareSpec

#: pages of 16 tokens both models share; each request below needs 3 (20 + 24 tokens)
BUDGET_PAGES = 14
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _config(checkpoint, budget_bytes: int) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), device="cpu", kv_cache_memory=budget_bytes,
                        max_num_seqs=4, max_model_len=128, block_size=16,
                        async_scheduling=False)


def _bytes_per_page(checkpoint) -> int:
    engine = LLMEngine(_config(checkpoint, 1 << 20))
    try:
        return engine.core.executor.bytes_per_block()
    finally:
        engine.shutdown()


def _engines(ledger_path: str, checkpoints, budget_bytes: int) -> list[LLMEngine]:
    KVLedger.create(ledger_path, len(checkpoints)).close()
    engines = []
    for slot, checkpoint in enumerate(checkpoints):
        config = _config(checkpoint, budget_bytes)
        core = EngineCore(config, kv_share=KVShareSpec(ledger_path, slot))
        engines.append(LLMEngine(config, client=InprocCoreClient(core)))
    return engines


def _run(engines: list[LLMEngine], jobs: list[list[list[int]]], ledger: KVLedger | None,
         budget: int) -> list[dict[str, list[int]]]:
    """Each engine's prompts, stepped in turn; the ledger checked after every step."""
    ids = [[engine.add_request(p, GREEDY) for p in prompts]
           for engine, prompts in zip(engines, jobs)]
    done: list[dict[str, list[int]]] = [{} for _ in engines]
    while any(len(d) < len(i) for d, i in zip(done, ids)):
        for k, engine in enumerate(engines):
            for out in engine.step(final_only=True):
                done[k][out.request_id] = out.outputs[0].token_ids
            if ledger is not None:
                with ledger.locked():
                    held = sum(s.held for s in ledger.slots())
                assert held <= budget, f"the models hold {held} bytes of {budget}"
    return [[d[r] for r in i] for d, i in zip(done, ids)]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    a, b = tiny_checkpoint("llama"), tiny_checkpoint("qwen3")
    return a, b, max(_bytes_per_page(a), _bytes_per_page(b))


def test_two_models_under_one_budget_give_their_outputs_alone(models, tmp_path):
    a, b, page = models
    budget = BUDGET_PAGES * page
    alone = []
    for i, checkpoint in enumerate((a, b)):
        [engine] = _engines(str(tmp_path / f"alone{i}"), [checkpoint], budget)
        alone.append(_run([engine], [PROMPTS], None, budget)[0])
        engine.shutdown()
    engines = _engines(str(tmp_path / "ledger"), [a, b], budget)
    ledger = KVLedger(str(tmp_path / "ledger"))
    try:
        together = _run(engines, [PROMPTS, PROMPTS[::-1]], ledger, ledger.budget)
        assert together[0] == alone[0]
        assert together[1] == alone[1][::-1]
    finally:
        for engine in engines:
            engine.shutdown()
        ledger.close()


def test_an_idle_models_cached_pages_go_to_the_busy_one_and_come_back(models, tmp_path):
    a, b, page = models
    budget = BUDGET_PAGES * page
    engines = _engines(str(tmp_path / "ledger"), [a, b], budget)
    ledger = KVLedger(str(tmp_path / "ledger"))
    first = engines[0]
    try:
        _run([first], [PROMPTS[:4]], ledger, ledger.budget)
        pool = first.core.block_manager
        assert pool.num_cached_blocks > 0  # idle, holding its prefixes
        cached = pool.num_cached_blocks
        _run(engines, [[], PROMPTS], ledger, ledger.budget)
        assert pool.num_cached_blocks < cached and pool.limit < BUDGET_PAGES
        # the busy one got room beyond an even split
        assert max(s.held for s in ledger.slots()[1:]) > ledger.budget // 2
        # and the first serves again, taking its share back
        _run(engines, [PROMPTS, []], ledger, ledger.budget)
        assert first.core.block_manager.limit > 0
        for engine in engines:
            engine.core.block_manager.check_invariants()
    finally:
        for engine in engines:
            engine.shutdown()
        ledger.close()


def test_an_embedding_model_beside_a_generating_one_takes_no_budget(models, tmp_path):
    """An encoder keeps no KV pages: it starts first (the first engine sets the budget)
    without setting it to nothing or dividing by its zero-byte page, and the generating
    model beside it runs as alone."""
    from tiny_encoders import build_bert

    llama, _, page = models
    bert = build_bert(tmp_path / "bert")
    ledger_path = str(tmp_path / "ledger")
    KVLedger.create(ledger_path, 2).close()
    budget = BUDGET_PAGES * page
    embed = EngineCore(EngineConfig(model=str(bert), device="cpu"),
                       kv_share=KVShareSpec(ledger_path, 0))
    config = _config(llama, budget)
    gen = LLMEngine(config, client=InprocCoreClient(
        EngineCore(config, kv_share=KVShareSpec(ledger_path, 1))))
    alone = LLMEngine(_config(llama, budget))
    try:
        assert gen.core.block_manager.num_blocks == budget // gen.core.executor.bytes_per_block()
        ledger = KVLedger(ledger_path)
        try:
            assert ledger.budget == budget  # set by the generating model, the encoder passed
            with ledger.locked():
                assert ledger.slots()[0].held == 0
        finally:
            ledger.close()
        got = _run([gen], [PROMPTS[:2]], None, budget)
        want = _run([alone], [PROMPTS[:2]], None, budget)
        assert got == want
    finally:
        for engine in (gen, alone):
            engine.shutdown()
        embed.shutdown()
