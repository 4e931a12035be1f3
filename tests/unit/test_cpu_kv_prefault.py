"""The cpu platform's ``kv_prefault`` option: when the KV pool's pages become resident
(a margin ahead of use in the background by default, all at allocation, or at each
page's first write), and that populating them in the background never changes what a
step already wrote."""

from __future__ import annotations

import gc
import mmap
import subprocess
import sys

import pytest
import torch
from quire.heap import give_back
from quire.platforms.cpu.kv_prefault import BackgroundPrefault, supported
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from residency import PAGE, resident_pages

# Run in a fresh process: in a long one, the allocator may hand back memory an earlier
# test already made resident, and the pool without the option would look prefaulted.
_PROBE = """
import ctypes, sys, torch
from quire.platforms.cpu.platform import CpuPlatform
libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
page = 4096
def resident(t):
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = (end - start + page - 1) // page
    flags = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, flags) == 0, ctypes.get_errno()
    return sum(b & 1 for b in flags.raw) / pages
platform = CpuPlatform()
platform.configure({"kv_prefault": sys.argv[1]})
backend = platform.make_attention_backend()
caches = [backend.allocate_kv_cache(512, 16, 8, 64, torch.float32, torch.device("cpu"))
          for _ in range(2)]  # 2 x 32 MiB
# what a step wrote before the thread got there: the first block's keys, the last's values
caches[0][0, 0].fill_(7.0)
caches[1][1, -1].fill_(-3.0)
assert backend.wait_for_prefault(120)
share = min(resident(c) for c in caches)  # before the reads below map the zero page
# the margin grows with use: once steps reach block 300 (of 512), the rest follows
if backend._background is not None:  # the thread the build_metadata calls would tell
    backend._background.reached(300)
assert backend.wait_for_prefault(120)
later = min(resident(c) for c in caches)
kept = bool((caches[0][0, 0] == 7).all() and (caches[1][1, -1] == -3).all())
rest = int(caches[0][0, 1:].count_nonzero() + caches[1][1, :-1].count_nonzero())
print(share, int(kept), rest, later)
"""


def test_the_option_is_parsed_and_checked() -> None:
    assert CpuOptions().kv_prefault == "background"
    assert CpuOptions.parse({"kv_prefault": "start"}, {}).kv_prefault == "start"
    assert CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "off"}).kv_prefault == "off"
    with pytest.raises(ValueError, match="kv_prefault"):
        CpuOptions(kv_prefault="yes")
    with pytest.raises(ValueError, match="QUIRE_CPU_KV_PREFAULT"):
        CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "true"})
    with pytest.raises(ValueError, match="prefault"):
        CpuSdpaAttentionBackend(prefault="sometimes")


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping")
@pytest.mark.parametrize("mode", ["off", "start", "background"])
def test_the_pool_becomes_resident_as_the_option_says(mode: str) -> None:
    """Two 32 MiB pools in a fresh process: every page resident after allocation
    (``start``); with ``background``, the thread's least margin ahead (32 MiB of keys
    and values over both pools: half of each) once it is done, the rest once steps
    reach block 300; the blocks written before it unchanged. Without either, almost
    none (a fresh mapping faults in on first write)."""
    if mode == "background" and not supported():
        pytest.skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
    out = subprocess.run([sys.executable, "-c", _PROBE, mode],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    share, kept, rest, later = out.stdout.split()
    assert kept == "1" and rest == "0"
    if mode == "off":
        assert float(share) < 0.25 and float(later) < 0.25
    elif mode == "start":
        assert float(share) == float(later) == 1.0
    else:
        # (plus the block the probe wrote at each value half's end)
        assert float(share) == pytest.approx(0.5, abs=0.01) and float(later) == 1.0


@pytest.mark.skipif(not supported(), reason="this kernel lacks MADV_POPULATE_WRITE")
def test_background_populating_races_no_writer() -> None:
    """Steps write the pool while the thread populates it: every value written stays,
    in every block, whichever of the two reached a page first."""
    prefault = BackgroundPrefault(chunk_bytes=8 << 10)  # many small calls, many races
    caches = [torch.empty(2, 2048, 16, 2, 32) for _ in range(4)]  # 4 x 16 MiB
    for cache in caches:
        prefault.add(cache)
    for block in range(2048):  # ascending, as the block manager hands them out
        for layer, cache in enumerate(caches):
            cache[:, block].fill_(float(layer * 4096 + block))
    assert prefault.idle.wait(120)
    for layer, cache in enumerate(caches):
        want = (torch.arange(2048, dtype=torch.float32) + layer * 4096).view(1, -1, 1, 1, 1)
        assert torch.equal(cache, want.expand_as(cache))


def test_a_freed_pool_ends_the_thread() -> None:
    """The thread holds the pools weakly: dropping them ends it, and a pool that is not
    a contiguous ``(2, num_blocks, ...)`` tensor is refused."""
    prefault = BackgroundPrefault(chunk_bytes=4 << 10)
    prefault.add(torch.empty(2, 4096, 16, 2, 32))
    with pytest.raises(ValueError, match="contiguous"):
        prefault.add(torch.empty(4096, 2, 16).transpose(0, 1))
    gc.collect()
    assert prefault.idle.wait(60)


def _resident_blocks(cache: torch.Tensor, half: int) -> list[bool]:
    """Whether each block of ``cache[half]`` is wholly resident (mincore)."""
    part = cache[half]
    block_bytes = part[0].numel() * part.element_size()
    start, bits = resident_pages(part)
    blocks = []
    for b in range(part.shape[0]):
        lo = (part.data_ptr() + b * block_bytes - start) // PAGE
        hi = (part.data_ptr() + (b + 1) * block_bytes - 1 - start) // PAGE
        blocks.append(all(bits[lo:hi + 1]))
    return blocks


@pytest.mark.skipif(not supported(), reason="this kernel lacks MADV_POPULATE_WRITE")
def test_only_a_margin_ahead_of_the_steps_is_made_resident() -> None:
    """With a margin of 256 blocks, the first 256 blocks of both halves are resident
    and the far end is not; once steps reach block 1000, blocks up to 1256 are."""
    # 128 MiB over a mapping of its own, so nothing of it is resident yet (torch.empty
    # may hand back memory the allocator of this long process kept)
    region = mmap.mmap(-1, 2 * 4096 * 16 * 4 * 64 * 4,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(region, dtype=torch.float32).view(2, 4096, 16, 4, 64)
    prefault = BackgroundPrefault(ahead_bytes=256 * 2 * 16 * 4 * 64 * 4)
    prefault.add(cache)
    assert prefault.idle.wait(60)
    for half in (0, 1):
        blocks = _resident_blocks(cache, half)
        assert all(blocks[:256]) and not any(blocks[512:]), half
    prefault.reached(1000)
    assert prefault.idle.wait(60)
    for half in (0, 1):
        blocks = _resident_blocks(cache, half)
        assert all(blocks[:1256]) and not any(blocks[1600:]), half
    prefault.stop()
    assert prefault.idle.wait(60)
    del cache


@pytest.mark.skipif(not supported(), reason="this kernel lacks MADV_POPULATE_WRITE")
def test_blocks_given_back_are_not_populated_ahead_again() -> None:
    """After blocks 128 and up are given back (a shared KV budget shrank the pool), the
    thread repopulates none of them ahead of use: a step reaching block 200 makes
    blocks up to 200 resident, not its 256-block margin beyond."""
    region = mmap.mmap(-1, 2 * 4096 * 16 * 4 * 64 * 4,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(region, dtype=torch.float32).view(2, 4096, 16, 4, 64)
    block = 16 * 4 * 64 * 4
    prefault = BackgroundPrefault(ahead_bytes=256 * 2 * block)
    prefault.add(cache)
    assert prefault.idle.wait(60)
    for half in (0, 1):
        assert give_back(cache[half, 128].data_ptr(), (4096 - 128) * block)
    prefault.released(128)
    for half in (0, 1):
        blocks = _resident_blocks(cache, half)
        assert all(blocks[:128]) and not any(blocks[128:]), half
    prefault.reached(200)
    assert prefault.idle.wait(60)
    for half in (0, 1):
        blocks = _resident_blocks(cache, half)
        assert all(blocks[:201]) and not any(blocks[201:]), half
    prefault.stop()
    assert prefault.idle.wait(60)
    del cache


# The exit the SIGABRT came from: the thread holds the last reference to a pool when the
# script's last line has run, frees it (a long munmap, without the GIL) while the
# interpreter begins to finalize, and asks for the GIL back too late. Before the thread
# was joined at exit this aborted every time ("terminate called without an active
# exception", exit -6).
_EXIT_WHILE_FREEING = """
import time, torch
from quire.platforms.cpu.kv_prefault import BackgroundPrefault
def main():
    prefault = BackgroundPrefault(ahead_bytes=1 << 40)
    pools = [torch.empty(2, 1024, 1 << 20, dtype=torch.uint8)]  # 2 GiB
    prefault.add(pools[0])
    time.sleep(1.0)  # the thread populates, holding the pool during each call
    del pools
    time.sleep(0.02)  # the thread drops the last reference and frees the pool
main()
"""


@pytest.mark.skipif(not supported(), reason="this kernel lacks MADV_POPULATE_WRITE")
def test_the_process_exits_cleanly_while_the_thread_frees_a_pool() -> None:
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _EXIT_WHILE_FREEING],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (out.returncode, out.stderr)
        assert "terminate called" not in out.stderr


def test_close_ends_the_thread_and_no_add_restarts_it() -> None:
    prefault = BackgroundPrefault(ahead_bytes=1 << 40, chunk_bytes=4 << 10)
    cache = torch.empty(2, 4096, 16, 2, 32)  # 32 MiB in 4 KiB calls: still running
    prefault.add(cache)
    thread = prefault._thread
    assert thread is not None
    prefault.close()
    assert not thread.is_alive()
    prefault.add(torch.empty(2, 16, 16))
    assert prefault._thread is None


@pytest.mark.skipif(not supported(), reason="this kernel lacks MADV_POPULATE_WRITE")
def test_the_margin_grows_with_use_between_its_bounds() -> None:
    """The margin is as much again as the steps have reached, at least
    ``min_ahead_bytes`` (64 blocks here) and at most ``ahead_bytes`` (1000): 64 blocks
    before any step, 300 more once steps reach block 299, and 1000 beyond block 2999."""
    region = mmap.mmap(-1, 2 * 4096 * 16 * 4 * 64 * 4,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(region, dtype=torch.float32).view(2, 4096, 16, 4, 64)
    pair = 2 * 16 * 4 * 64 * 4  # a block of keys and its block of values
    prefault = BackgroundPrefault(ahead_bytes=1000 * pair, min_ahead_bytes=64 * pair)
    prefault.add(cache)
    for frontier, resident in ((None, 64), (299, 600), (2999, 4000)):
        if frontier is not None:
            prefault.reached(frontier)
        assert prefault.idle.wait(60)
        for half in (0, 1):
            blocks = _resident_blocks(cache, half)
            # a page may straddle the last block's end: a few blocks' slack past it
            assert all(blocks[:resident]) and not any(blocks[resident + 8:]), (frontier, half)
    prefault.stop()
    assert prefault.idle.wait(60)
    del cache
