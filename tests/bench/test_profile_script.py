"""``scripts/profile_steps.py`` runs on the tiny model and prints its tables (no timing
is asserted): the script is what a GPU session runs first, so it must not rot here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_steps.py"


def test_profile_steps_on_the_tiny_model(tiny_path):
    argv = [sys.executable, str(SCRIPT), "--model", tiny_path, "--device", "cpu",
            "--kv-cache-memory", "4MiB", "--batch", "3", "--prompt-len", "9", "--steps", "2",
            "--top", "5"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cpu, 3 sequences, 2 decode steps: median" in done.stdout
    assert "Self CPU time total" in done.stdout
