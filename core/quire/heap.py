"""The process's memory and the OS: the C heap's freed memory given back, and mapped
pages made writable in one call.

Loading a model frees much of what it allocated: a tokenizer's JSON parsed into a tree
(several times the file's size), a GGUF file's metadata, a profiling step's
activations. glibc's allocator keeps such memory for reuse, and it stays resident until
reused, so a process that is done loading holds it for good. :func:`release_freed_heap`
hands it back once a tokenizer is loaded (before the weights, whose pages would add to
it), and once when loading is over.

Writing over a private (copy-on-write) map of a file takes one page fault per page,
each copying its page: for llama's q/k rows, reordered in a GGUF file's map, that was
much of a load (docs/quantization.md, "Loading"). :func:`populate_for_writing` has the
kernel copy a range's pages in one ``madvise`` call first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap


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


#: madvise's MADV_POPULATE_WRITE (Linux 5.14 on): fault a range in as if written.
_MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise():  # a ctypes function, or None
    name = ctypes.util.find_library("c")
    try:
        madvise = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def populate_for_writing(address: int, nbytes: int) -> bool:
    """Fault in the pages under ``[address, address + nbytes)`` as writes would, in one
    call (``madvise(MADV_POPULATE_WRITE)``): in a private map of a file, each page
    becomes the process's own copy there and then. The file is never written, and the
    bytes read the same. False where the call is missing or refused (a kernel before
    5.14, not Linux): the writes then fault page by page, as without it."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return False
    page = mmap.PAGESIZE
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return madvise(start, end - start, _MADV_POPULATE_WRITE) == 0
