"""Which pages of a tensor the process holds (Linux's ``mincore``), for tests of memory
that must not become resident before it is written."""

from __future__ import annotations

import ctypes

import torch

PAGE = 4096


def resident_pages(tensor: torch.Tensor) -> tuple[int, list[bool]]:
    """(the address of the first page, whether each page from it is resident) for the
    bytes of ``tensor`` (contiguous)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr() // PAGE * PAGE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    flags = ctypes.create_string_buffer((end - start + PAGE - 1) // PAGE)
    assert libc.mincore(start, end - start, flags) == 0, ctypes.get_errno()
    return start, [bool(b & 1) for b in flags.raw]
