"""``quire serve``'s listening socket, bound before anything loads.

The socket is bound once, first, and handed to uvicorn; with ``--api-server-count N`` its
file descriptor is passed to the N API server processes, which share it (the kernel
spreads the connections over them). So a port in use, or a host that is not this
machine's, is one line naming the flag before the model loads rather than a traceback
after it, and nothing can take the port between a check and the bind.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from quire.entrypoints.cli.common import UsageError

#: Connections the kernel queues before uvicorn accepts them (uvicorn's default).
BACKLOG = 2048
#: The largest TCP port.
MAX_PORT = 65535


def check_port(port: int) -> None:
    """:raises UsageError: naming ``--port`` when ``port`` is no TCP port (0 is any free one)."""
    if not 0 <= port <= MAX_PORT:
        raise UsageError(f"--port: must be 0-{MAX_PORT} (0: any free port), got {port}")


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port`` 0: one the kernel picks).

    An IPv6 literal (a ``:`` in ``host``) binds IPv6, anything else IPv4, as uvicorn binds
    a socket it hands to its workers.

    :raises UsageError: naming ``--port`` (out of range, in use, privileged) or ``--host``
        (unresolvable, not this machine's), with the address.
    """
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = _resolve(host, port, family)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise UsageError(_bind_error(host, port, exc)) from exc
    return sock


def probe_port(host: str, port: int, flag: str) -> int:
    """Bind ``host:port`` for a moment, without ``SO_REUSEPORT``, and let it go: the
    port a server of another kind (gRPC) will bind later, after the model loaded, is
    checked now, and ``port`` 0 becomes the free port the kernel picked.

    :raises UsageError: naming ``flag`` or ``--host``, as :func:`bind_listener`.
    """
    if not 0 <= port <= MAX_PORT:
        raise UsageError(f"{flag}: must be 0-{MAX_PORT} (0: any free port), got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = _resolve(host, port, family)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(_bind_error(host, port, exc, flag)) from exc
        return int(sock.getsockname()[1])


def url(host: str, listener: socket.socket) -> str:
    """``http://host:port`` of ``listener``, with the port it got (for ``--port 0``)."""
    return f"http://{_host_port(host, listener.getsockname()[1])}"


def _resolve(host: str, port: int, family: socket.AddressFamily) -> tuple[Any, ...]:
    """The address ``bind`` takes for ``host``. :raises UsageError: naming ``--host``."""
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0,
                                   socket.AI_PASSIVE)
    except socket.gaierror as exc:
        kind = "IPv6" if family == socket.AF_INET6 else "IPv4"
        raise UsageError(f"--host: cannot resolve {host!r} to an {kind} address "
                         f"({exc.strerror})") from exc
    return infos[0][4]


def _bind_error(host: str, port: int, exc: OSError, flag: str = "--port") -> str:
    """The one line that says why ``host:port`` could not be bound, naming the flag."""
    where = _host_port(host, port)
    if exc.errno == errno.EADDRINUSE:
        return (f"{flag}: {where} is already in use; stop what listens there or choose "
                f"another {flag} (0: any free port)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host: cannot bind {where}: {host!r} is not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"{flag}: cannot bind {where}: permission denied (ports below 1024 need " \
               f"privileges)"
    return f"--host/{flag}: cannot bind {where}: {exc.strerror or exc}"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
