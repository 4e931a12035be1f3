"""The whole conformance suite against the cpu platform: every check must pass.

Collected as ``test_cpu_conformance[platform]``, ``[kv-write]``, ``[attention]``,
``[memory]``, ``[communicator]`` (collectives and send/recv; world sizes 2 and 4 spawn
gloo ranks on the host) and ``[end-to-end]``: the same entry point a vendor uses for its
own plugin.
"""

from quire.conformance.pytest_plugin import conformance_tests

test_cpu_conformance = conformance_tests("cpu", require_available=True)
