"""quire.entrypoints.launch: the console script imports the command line without a full
garbage collection, restores the collector's thresholds, freezes what the imports made,
and runs the command. In a fresh process, since the point is the first import."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import gc, json
defaults = gc.get_threshold()
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(1))
from quire.entrypoints.launch import main
code = main(["--help"])
print(json.dumps({"code": code, "full": len(full), "restored": gc.get_threshold() == defaults,
                  "frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}))
"""


def test_the_command_line_imports_without_a_full_collection() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=300, check=True)
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "usage: quire" in out.stdout
    assert result["code"] == 0
    assert result["full"] == 0  # several without the launcher (torch, transformers...)
    assert result["restored"] and result["enabled"]
    assert result["frozen"] > 10_000  # the imports' objects, in the permanent generation
