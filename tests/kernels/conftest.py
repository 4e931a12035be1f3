"""Run this directory's Triton kernels in Triton's interpreter, on CPU tensors.

``TRITON_INTERPRET=1`` must be in the environment before triton is first imported (and, at
the latest, before ``quire.kernels.triton_attention`` is: ``@triton.jit`` reads it when a
kernel is defined and builds an interpreted or a compiled kernel for good). pytest imports
this file before any test module of this directory, so it is set here, at import time.

The variable is process-wide, so tests collected after this directory see it too; nothing
else in the suite imports triton. If the kernels were already imported compiled (for
instance by a plugin imported earlier in the same process), the run stops with a message
rather than failing in every test.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_kernels = sys.modules.get("quire.kernels.triton_attention")
if _kernels is not None and not _kernels.INTERPRETED:
    raise RuntimeError(
        "quire.kernels.triton_attention was imported before tests/kernels/conftest.py set "
        "TRITON_INTERPRET=1; run tests/kernels in a fresh process"
    )
