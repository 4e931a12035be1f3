"""vLLM's ``gpu_memory_utilization``: the share of the device's total memory an engine may
hold; the KV cache gets what the weights and activations leave. Checked on a profiler with
fixed readings, and end to end on the cpu platform."""

from __future__ import annotations

import pytest
from quire import LLM
from quire.config import EngineConfig
from quire.entrypoints.cli import main
from quire.interfaces.memory import MemoryProfiler


class _Fixed(MemoryProfiler):
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free

    def total_memory(self) -> int:
        return self.total

    def free_memory(self) -> int:
        return self.free

    def reset_peak(self) -> None:
        pass

    def peak_memory(self) -> int:
        return 0


def test_the_kv_cache_gets_what_the_share_leaves():
    assert _Fixed(1000, 600).utilization_budget(0.5, held=100, activation_peak=50) == 350


@pytest.mark.parametrize("total, free, share, held, words", [
    (1000, 600, 0.1, 100, "leaves no memory"),
    (1000, 200, 0.9, 100, "only 200 are free"),
])
def test_a_share_that_cannot_be_met_is_refused(total, free, share, held, words):
    with pytest.raises(ValueError, match=words) as refused:
        _Fixed(total, free).utilization_budget(share, held)
    assert "gpu_memory_utilization" in str(refused.value)


@pytest.mark.parametrize("options, words", [
    ({"gpu_memory_utilization": 0.0}, r"\(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"\(0, 1\]"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_memory": 0.5}, "give one"),
])
def test_bad_options_are_refused(options, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs("m", **options)


def test_the_flag_exists_and_names_itself(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--gpu-memory-utilization", "2",
                 "--prompt", "x"]) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err


def test_an_engine_sized_by_its_share_runs(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), device="cpu", gpu_memory_utilization=0.5) as llm:
        assert llm.engine.core.block_manager.num_blocks > 0
        assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids
