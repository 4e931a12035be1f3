"""The ``ray`` executor: tensor and pipeline parallelism over Ray actors, on one local node
and over a two-node cluster on this machine (``ray.cluster_utils.Cluster``, one CPU per
node, so the two ranks must land on different nodes). Slow: a Ray cluster takes seconds
to start."""

from __future__ import annotations

import pytest
from quire import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("arch, split", [
    ("llama", {"tensor_parallel_size": 2}),  # one tensor-parallel rank per node
    ("qwen2", {"pipeline_parallel_size": 2}),  # one stage per node, the tied head on the 2nd
])
def test_two_ray_nodes_equal_one_process(tiny_checkpoint, arch, split):
    from ray.cluster_utils import Cluster

    path = str(tiny_checkpoint(arch))
    with LLM(path, device="cpu", max_model_len=128) as one:
        expected = _greedy(one)
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        with LLM(path, device="cpu", max_model_len=128, distributed_executor_backend="ray",
                 **split) as llm:
            nodes = llm.engine.core.executor.node_ids  # type: ignore[attr-defined]
            assert len(set(nodes)) == 2, nodes  # one rank on each node
            assert _greedy(llm) == expected
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_a_killed_ray_worker_is_reported(tiny_checkpoint):
    from quire.config import EngineConfig
    from quire.engine import LLMEngine
    from quire.executor.abstract import WorkerDied

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        engine = LLMEngine(EngineConfig.from_kwargs(
            str(tiny_checkpoint("llama")), device="cpu", max_model_len=128,
            tensor_parallel_size=2, distributed_executor_backend="ray"))
        try:
            ray.kill(engine.core.executor._actors[1])  # type: ignore[attr-defined]
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
            with pytest.raises(WorkerDied, match="Ray worker died"):
                while engine.has_unfinished_requests():
                    engine.step()
        finally:
            engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_data_parallel_replicas_on_two_ray_nodes(tiny_checkpoint, monkeypatch):
    """DP=2 over Ray: each engine core process joins the cluster RAY_ADDRESS names and
    places its one rank in its own placement group (one CPU per node: one per node)."""
    from ray.cluster_utils import Cluster

    path = str(tiny_checkpoint("llama"))
    with LLM(path, device="cpu", max_model_len=128) as one:
        expected = _greedy(one)
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    try:
        with LLM(path, device="cpu", max_model_len=128, data_parallel_size=2,
                 distributed_executor_backend="ray") as llm:
            assert _greedy(llm) == expected
            assert all(llm.engine.client.placement.placed)  # type: ignore[attr-defined]
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_ray_actors_start_with_what_the_engines_platform_asks_for(tiny_checkpoint,
                                                                  monkeypatch):
    """As ``mp`` workers: the cpu platform's wait policy is in each actor's environment
    from its start (Ray's runtime environment), when torch loads there."""
    import os

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        with LLM(str(tiny_checkpoint("llama")), device="cpu", max_model_len=128,
                 tensor_parallel_size=2, distributed_executor_backend="ray",
                 platform_options={"wait_policy": "passive"}) as llm:
            actors = llm.engine.core.executor._actors  # type: ignore[attr-defined]
            seen = ray.get([a.__ray_call__.remote(
                lambda self: os.environ.get("OMP_WAIT_POLICY")) for a in actors])
            assert seen == ["PASSIVE", "PASSIVE"]
            assert len(_greedy(llm)) == len(PROMPTS)
    finally:
        ray.shutdown()
    assert "OMP_WAIT_POLICY" not in os.environ  # this process is left as it was
