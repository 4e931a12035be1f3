"""The suite leaves the user's quire cache as it found it: tests that write the cache
(the cpu platform's dispatch timings, a GGUF file's converted config and tokenizer) run
in a child pytest whose user cache is a scratch directory, which must stay empty.

A run in a child with a cache of its own, rather than a check of the real
``~/.cache/quire`` after the session, so that a user's own ``quire serve`` writing there
meanwhile (the README's two quick-start commands, in two shells) cannot fail the suite.
``tests/conftest.py`` still reports such a change of the real cache, as a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Tests that wrote into the user's cache before the suite had a cache of its own.
WRITERS = [
    "tests/unit/test_cpu_dispatch.py",
    "tests/unit/test_models.py::test_gguf_conversion_roundtrip_matches_transformers",
]


def test_tests_that_write_the_cache_leave_the_users_untouched(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "QUIRE_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # the child's user cache
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-x", *WRITERS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    user_cache = tmp_path / "xdg" / "quire"
    written = sorted(str(p.relative_to(user_cache)) for p in user_cache.rglob("*")) \
        if user_cache.exists() else []
    assert written == [], f"the tests wrote into the user's cache: {written[:10]}"
