"""The profile cache: a start with the same model, options and code reads the activation
peak an earlier start measured; whatever shapes the profiling forward measures again."""

from __future__ import annotations

import os

import pytest
from quire.config import EngineConfig
from quire.executor.profile_cache import ProfileCache, profile_key
from quire.executor.worker import Worker, resolve_config
from quire.platforms.cpu.platform import CpuPlatform


def test_entries_round_trip_and_bad_ones_read_as_missing(tmp_path):
    cache = ProfileCache(tmp_path)
    assert cache.get("k") is None
    cache.put("k", 123456)
    assert cache.get("k") == 123456
    for text in ("not json", '{"activation_peak": -1}', '{"activation_peak": "1"}', "{}"):
        (tmp_path / "bad.json").write_text(text)
        assert cache.get("bad") is None, text


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ProfileCache(blocker / "profile")  # under a file: mkdir fails
    cache.put("k", 1)
    assert cache.get("k") is None


def _key(path, platform, *, rank=0, tokens=256, **options):
    config = resolve_config(EngineConfig.from_kwargs(str(path), device="cpu", **options),
                            platform)
    return profile_key(config, model_paths=[str(path)], platform=platform, rank=rank,
                       world_size=1, ranks_on_host=1, tokens=tokens)


def test_the_key_follows_what_shapes_the_forward(tiny_checkpoint, tmp_path):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), path)
    platform = CpuPlatform()
    base = _key(path, platform)
    assert _key(path, platform) == base
    # what does not shape a forward keeps the entry
    assert _key(path, platform, seed=7, kv_cache_memory=0.3) == base
    # what does, measures again
    for changed in (_key(path, platform, max_num_batched_tokens=512),
                    _key(path, platform, dtype="bfloat16"),
                    _key(path, platform, max_model_len=64),
                    _key(path, platform, rank=1),
                    _key(path, platform, tokens=128),
                    _key(path, platform, platform_options={"attention": "reference"})):
        assert changed != base
    weights = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    os.utime(weights, ns=(1, 1))  # a rewritten checkpoint
    assert _key(path, platform) != base


def test_a_second_start_reads_the_peak_the_first_measured(tiny_checkpoint, monkeypatch):
    runs: list[int] = []
    measure = Worker._profile_run

    def counted(self, num_tokens):
        runs.append(num_tokens)
        return measure(self, num_tokens)

    monkeypatch.setattr(Worker, "_profile_run", counted)
    peaks: list[int] = []
    keep = Worker._activation_peak
    monkeypatch.setattr(Worker, "_activation_peak",
                        lambda self, *a: peaks.append(keep(self, *a)) or peaks[-1])
    config = EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                      max_model_len=96, max_num_batched_tokens=96)
    first = Worker(config).num_kv_blocks()
    assert len(runs) == 1
    second = Worker(config).num_kv_blocks()
    assert len(runs) == 1 and peaks[0] == peaks[1] and second > 0 and first > 0
    Worker(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                    max_model_len=96, max_num_batched_tokens=80)
           ).num_kv_blocks()
    assert len(runs) == 2  # another step size: measured


def test_a_budget_in_bytes_runs_no_profile(tiny_checkpoint, monkeypatch):
    """An absolute ``kv_cache_memory`` needs no activation peak: nothing is measured or
    read."""
    monkeypatch.setattr(Worker, "_activation_peak",
                        lambda *a: pytest.fail("profiled for an absolute budget"))
    config = EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                      max_model_len=96, kv_cache_memory=1 << 24)
    assert Worker(config).num_kv_blocks() > 0
