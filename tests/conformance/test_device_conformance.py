"""The conformance suite against the platform CI names, for the accelerator jobs of
.github/workflows/conformance.yml: ``QUIRE_CONFORMANCE_DEVICE=cuda`` (and
``QUIRE_CONFORMANCE_KERNELS_ONLY=1`` for the interpreter job). Skipped when unset, so the
default suite does not depend on what hardware is attached.

Availability is required: on a runner labelled for an accelerator, a platform that is not
available is a broken runner, not a pass.
"""

from __future__ import annotations

import os

import pytest

from quire.conformance.pytest_plugin import conformance_tests

DEVICE = os.environ.get("QUIRE_CONFORMANCE_DEVICE")

if DEVICE:
    test_device_conformance = conformance_tests(
        DEVICE,
        kernels_only=os.environ.get("QUIRE_CONFORMANCE_KERNELS_ONLY") == "1",
        require_available=True,
    )
else:

    def test_device_conformance() -> None:
        pytest.skip("set QUIRE_CONFORMANCE_DEVICE to a platform name to run this")
