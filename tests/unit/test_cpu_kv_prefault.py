"""The cpu platform's ``kv_prefault`` option: the KV pool written once at allocation
(every page resident before the first step), or left to fault in page by page."""

from __future__ import annotations

import subprocess
import sys

import pytest
from quire.platforms.cpu.options import CpuOptions

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
cache = platform.make_attention_backend().allocate_kv_cache(
    1024, 16, 8, 64, torch.float32, torch.device("cpu"))  # 64 MiB
print(resident(cache), int(cache.any()))
"""


def test_the_option_is_parsed_and_checked() -> None:
    assert CpuOptions().kv_prefault is False
    assert CpuOptions.parse({"kv_prefault": "true"}, {}).kv_prefault is True
    assert CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "1"}).kv_prefault is True
    with pytest.raises(ValueError, match="kv_prefault"):
        CpuOptions(kv_prefault="yes")
    with pytest.raises(ValueError, match="QUIRE_CPU_KV_PREFAULT"):
        CpuOptions.parse({}, {"QUIRE_CPU_KV_PREFAULT": "maybe"})


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping")
@pytest.mark.parametrize("prefault", [False, True])
def test_a_prefaulted_pool_is_resident_before_any_write(prefault: bool) -> None:
    """A 64 MiB pool in a fresh process: with the option every page of it is resident
    right after allocation (zeros); without, almost none (a fresh mapping faults in
    on first write)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, str(prefault).lower()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    share, nonzero = out.stdout.split()
    if prefault:
        assert float(share) == 1.0 and nonzero == "0"
    else:
        assert float(share) < 0.25
