"""The cpu platform's ``kv_prefault`` option: the KV pool written once at allocation
(every page resident before the first step), or left to fault in page by page."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.platform import CpuPlatform

SMAPS = Path("/proc/self/smaps_rollup")


def _rss_kib() -> int:
    for line in SMAPS.read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no Rss line")


def test_the_option_is_parsed_and_checked() -> None:
    assert CpuOptions().kv_prefault is False
    assert CpuOptions.parse({"kv_prefault": "true"}, {}).kv_prefault is True
    assert CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "1"}).kv_prefault is True
    with pytest.raises(ValueError, match="kv_prefault"):
        CpuOptions(kv_prefault="yes")
    with pytest.raises(ValueError, match="QUIRE_CPU_KV_PREFAULT"):
        CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "maybe"})


@pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps_rollup")
@pytest.mark.parametrize("prefault", [False, True])
def test_a_prefaulted_pool_is_resident_before_any_write(prefault: bool) -> None:
    """64 MiB of pool: with the option all of it counts in the process's resident set
    right after allocation; without, almost none of it (the allocator's fresh mapping
    faults in on first write)."""
    platform = CpuPlatform()
    platform.configure({"kv_prefault": str(prefault).lower()})
    backend = platform.make_attention_backend()
    # 2 x 1024 blocks x 16 slots x 8 heads x 64 x 4 bytes = 64 MiB
    before = _rss_kib()
    cache = backend.allocate_kv_cache(1024, 16, 8, 64, torch.float32, torch.device("cpu"))
    grown = _rss_kib() - before
    size_kib = cache.numel() * cache.element_size() // 1024
    assert size_kib == 64 * 1024
    if prefault:
        assert grown >= 0.95 * size_kib and not cache.any()
    else:
        assert grown < 0.25 * size_kib
