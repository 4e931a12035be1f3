"""Giving the C heap's freed memory back to the OS.

Loading a model frees much of what it allocated: a tokenizer's JSON parsed into a tree
(several times the file's size), a GGUF file's metadata, a profiling step's
activations. glibc's allocator keeps such memory for reuse, and it stays resident until
reused, so a process that is done loading holds it for good. :func:`release_freed_heap`
hands it back once a tokenizer is loaded (before the weights, whose pages would add to
it), and once when loading is over.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # a ctypes function, or None
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def release_freed_heap() -> bool:
    """Return the whole free pages of the C heap to the OS (``malloc_trim(0)``); False
    where the C library has no such call (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
