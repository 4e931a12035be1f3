"""``TokenizerPool``: blocking request work (JSON parsing, chat templates, tokenization,
detokenization, fetching, decoding and preprocessing a chat's images) on worker threads,
so the event loop stays free for every other client.

Fast tokenizers release the GIL while they encode, so a large prompt on a worker costs
the loop nothing; Python-level work (JSON, Jinja) shares the GIL in 5 ms slices, which
keeps ``/health`` and streams answering meanwhile. Each worker thread has its own copy of
the tokenizer: one fast-tokenizer instance used by two threads at once fails ("Already
borrowed").
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Worker threads: enough that one huge request does not queue every small one behind it.
DEFAULT_WORKERS = 4


class TokenizerPool:
    """Runs ``fn(*args, tokenizer=...)`` on a worker thread with that thread's tokenizer."""

    def __init__(self, tokenizer: Any, workers: int = DEFAULT_WORKERS) -> None:
        self._prototype = tokenizer
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="quire-tokenize")

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._prototype)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args, tokenizer=...)`` on a worker; its exceptions are raised here."""
        def call() -> T:
            return fn(*args, tokenizer=self._tokenizer())

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Stop the workers once their current work is done."""
        self._executor.shutdown(wait=False, cancel_futures=True)
