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
much of a load (docs/quantization.md, "Loading"). :func:`populate_write` has the
kernel copy a range's pages in one ``madvise`` call first. The cpu platform's KV pool
uses it too, and :func:`give_back` to return pages (``platforms/cpu/kv_prefault.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)


@functools.cache
def _libc(name: str, argtypes: tuple[type, ...]):  # a ctypes function, or None
    """The C library's function ``name`` returning an int; None where it has none (not
    glibc, not Linux)."""
    library = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(library, use_errno=True), name) if library else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.argtypes = list(argtypes)
        function.restype = ctypes.c_int
    return function


def release_freed_heap() -> bool:
    """Return the whole free pages of the C heap to the OS (``malloc_trim(0)``); False
    where the C library has no such call (not glibc)."""
    trim = _libc("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True


#: madvise's advice: fault a range in as if written (Linux 5.14 on); drop its pages.
MADV_POPULATE_WRITE = 23
MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise():  # a ctypes function, or None where there is no such call
    if not sys.platform.startswith("linux"):
        return None
    return _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def populate_write(address: int, length: int) -> bool:
    """Fault ``[address, address + length)`` in as writes would, without changing its
    contents (the range widened to whole pages), in one call: in a private map of a
    file each page becomes the process's own copy there and then, and the file is never
    written. False where the OS cannot (not Linux, a kernel before 5.14): writes then
    fault page by page, as without it."""
    madvise = _madvise()
    if madvise is None or length <= 0:
        return False
    start = address // _PAGE * _PAGE
    end = -(-(address + length) // _PAGE) * _PAGE
    if madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    logger.info("madvise(MADV_POPULATE_WRITE) of %d bytes failed: %s", end - start,
                os.strerror(ctypes.get_errno()))
    return False


def give_back(address: int, length: int) -> bool:
    """Give the whole OS pages inside ``[address, address + length)`` back (they read as
    zeros when touched again); the pages the range only partly covers are kept, so memory
    around it is never lost. False where the OS cannot."""
    madvise = _madvise()
    if madvise is None:
        return False
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if end <= start:
        return True
    if madvise(start, end - start, MADV_DONTNEED) == 0:
        return True
    logger.info("madvise(MADV_DONTNEED) of %d bytes failed: %s", end - start,
                os.strerror(ctypes.get_errno()))
    return False


def can_give_back() -> bool:
    """Whether :func:`give_back` can work here (Linux's ``madvise``)."""
    return _madvise() is not None
