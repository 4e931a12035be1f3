"""Images named by vision-language requests, loaded under a :class:`MediaPolicy`.

A request names an image by URL (OpenAI's ``image_url``: ``data:``, ``http(s)://``,
``file://``) or as base64 with a media type (Anthropic's ``source``), as vLLM's
``MediaConnector`` takes them. The client is not trusted, so every way in is bounded:

- http(s): the host is resolved once and every address checked before connecting; the
  connection goes to a checked address while the request keeps the URL's host name
  (Host header, SNI), so a second DNS answer cannot swap it (rebinding). Redirects are
  followed by hand, each hop checked again. Size and total time are capped.
- file: only under one configured directory, after ``..`` and symlinks are resolved.
- decoding: the pixel count is read from the header and checked before any pixel is
  decoded (a small file can declare a huge image); truncated data is refused, not padded.

Synchronous: the server runs :func:`load_image` on a worker thread.
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import ipaddress
import os
import re
import socket
import ssl
import string
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit
from urllib.request import url2pathname

from PIL import Image

_MIB = 1024 * 1024
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_REDIRECTS = frozenset((301, 302, 303, 307, 308))
_ANTHROPIC_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_CHUNK = 64 * 1024
#: NAT64's well-known prefix: the last 32 bits are an IPv4 address a gateway reaches.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_WHITE = (255, 255, 255)
#: What PIL raises on data it cannot read, header or pixels.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


class MediaError(ValueError):
    """A request's image that cannot be used; the message names the request part."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(where, reason)
        self.where = where
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class MediaPolicy:
    """Where a request's images may come from and how large they may be."""

    #: Directory that ``file://`` URLs may read under (``..`` and symlinks resolved);
    #: ``None`` refuses every ``file://`` URL.
    allowed_local_media_path: str | None = None
    #: When non-empty, the only hosts http(s) URLs may name; these may then resolve to
    #: private or loopback addresses (an internal image store). When empty, any host may
    #: be named but none that resolves to a non-public address.
    allowed_media_domains: tuple[str, ...] = ()
    #: Largest encoded image accepted, from any source.
    max_bytes: int = 20 * _MIB
    #: Deadline of a whole fetch in seconds: connects, redirects, headers and body.
    timeout_s: float = 10.0
    #: Redirects followed before a fetch is refused.
    max_redirects: int = 3
    #: Largest width * height decoded: the decompression-bomb guard, checked from the
    #: header before any pixel is decoded.
    max_pixels: int = 40_000_000
    #: Largest ratio of the longer side to the shorter: a processor that resizes the
    #: shorter side up would otherwise turn a 1-pixel-high strip into a huge image
    #: (Qwen2-VL's processor refuses past the same ratio).
    max_aspect_ratio: float = 200.0
    #: PIL formats that may be opened; no other decoder is tried (EPS would run
    #: Ghostscript, for one).
    formats: tuple[str, ...] = ("JPEG", "PNG", "GIF", "WEBP", "BMP")

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "timeout_s", "max_aspect_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MediaPolicy.{name} must be positive, got {getattr(self, name)}")
        if self.max_redirects < 0:
            raise ValueError(f"MediaPolicy.max_redirects must be >= 0, got {self.max_redirects}")
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"MediaPolicy.allowed_local_media_path {path!r} is not a directory")
        if not all(isinstance(d, str) and d.strip(".") for d in self.allowed_media_domains):
            raise ValueError(f"MediaPolicy.allowed_media_domains has an empty or non-string "
                             f"entry: {self.allowed_media_domains!r}")


def media_policy(engine: Any) -> MediaPolicy:
    """The policy an engine's options set (``EngineConfig``'s
    ``allowed_local_media_path`` and comma-separated ``allowed_media_domains``)."""
    domains = tuple(d.strip().lower() for d in (engine.allowed_media_domains or "").split(",")
                    if d.strip())
    return MediaPolicy(allowed_local_media_path=engine.allowed_local_media_path,
                       allowed_media_domains=domains)


def load_image(url: str, where: str, policy: MediaPolicy) -> Image.Image:
    """The RGB image ``url`` names (``data:``, ``http(s)://`` or ``file://``).

    :raises MediaError: naming ``where`` when the policy refuses it or it is no image.
    """
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        data = _read_data_url(url, where, policy)
    elif scheme in ("http", "https"):
        data = _fetch(url, where, policy)
    elif scheme == "file":
        data = _read_file(url, where, policy)
    else:
        raise MediaError(where, f"unsupported URL scheme {scheme!r} "
                                "(data, http, https and file are supported)")
    return decode_image(data, where, policy)


def load_image_base64(data: str, media_type: str | None, where: str,
                      policy: MediaPolicy) -> Image.Image:
    """The RGB image of an Anthropic base64 source (``media_type`` is checked when given).

    :raises MediaError: naming ``where``.
    """
    if media_type is not None and media_type.lower() not in _ANTHROPIC_TYPES:
        raise MediaError(where, f"media_type {media_type!r} is not one of "
                                f"{', '.join(_ANTHROPIC_TYPES)}")
    return decode_image(_b64decode(data, where, policy), where, policy)


def decode_image(data: bytes, where: str, policy: MediaPolicy) -> Image.Image:
    """``data`` decoded to an RGB image, its size checked before its pixels are decoded.

    :raises MediaError: naming ``where``: too large, not an image, or truncated.
    """
    if len(data) > policy.max_bytes:
        raise MediaError(where, f"image is over {policy.max_bytes} bytes")
    try:
        # reads the header only; PIL's own bomb check (its global limit) may refuse here
        image = Image.open(io.BytesIO(data), formats=policy.formats)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(where, f"decompression bomb refused: {exc}") from None
    except _DECODE_ERRORS:
        raise MediaError(where, f"not an image (or not one of {', '.join(policy.formats)})"
                         ) from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(where, f"image of {width}x{height} pixels is over the limit of "
                                f"{policy.max_pixels} (decompression-bomb guard)")
    if max(width, height) > policy.max_aspect_ratio * max(1, min(width, height)):
        raise MediaError(where, f"image of {width}x{height} pixels is longer than "
                                f"{policy.max_aspect_ratio:g} times its width or height")
    try:
        image.load()
    except _DECODE_ERRORS as exc:
        raise MediaError(where, f"truncated or corrupt image data ({exc})") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB with transparent pixels over white, as vLLM does: what lies under full
    transparency is often black or noise, which the model would otherwise see."""
    if image.mode == "RGB":
        return image
    if not image.has_transparency_data:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, _WHITE)
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


# data: and base64


def _read_data_url(url: str, where: str, policy: MediaPolicy) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL."""
    header, comma, payload = url[len("data:"):].partition(",")
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if not comma or not media_type.startswith("image/"):
        raise MediaError(where, f"a data URL must hold an image, not {media_type!r}")
    if "base64" not in params:
        raise MediaError(where, "a data URL must be base64-encoded")
    return _b64decode(payload, where, policy)


def _b64decode(text: str, where: str, policy: MediaPolicy) -> bytes:
    """Strict base64, its length checked against ``max_bytes`` before decoding."""
    if len(text) > 4 * -(-policy.max_bytes // 3):
        raise MediaError(where, f"image is over {policy.max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, or non-ASCII text
        raise MediaError(where, "invalid base64") from None


# file:


def _read_file(url: str, where: str, policy: MediaPolicy) -> bytes:
    """A local file's bytes, when it resolves to a file under the allowed directory."""
    if policy.allowed_local_media_path is None:
        raise MediaError(where, "file:// URLs are refused (no allowed local media path set)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(where, f"file:// URL names host {parts.netloc!r}; only local files")
    name = url2pathname(parts.path)
    if not os.path.isabs(name):
        raise MediaError(where, "file:// URL must hold an absolute path")
    root = Path(policy.allowed_local_media_path).resolve()
    try:
        path = Path(name).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise MediaError(where, "no such file") from None
    if not path.is_relative_to(root):
        raise MediaError(where, "file is outside the allowed local media path")
    if not path.is_file():
        raise MediaError(where, "not a regular file")
    return _read_capped(path, where, policy)


def _read_capped(path: Path, where: str, policy: MediaPolicy) -> bytes:
    """At most ``max_bytes`` of a resolved path, opened without following a symlink that
    replaced it since it was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as file:
            data = file.read(policy.max_bytes + 1)
    except OSError as exc:
        raise MediaError(where, f"cannot read file: {exc.strerror}") from None
    if len(data) > policy.max_bytes:
        raise MediaError(where, f"image is over {policy.max_bytes} bytes")
    return data


# http(s):


def _fetch(url: str, where: str, policy: MediaPolicy) -> bytes:
    """The body of ``url`` after at most ``max_redirects`` redirects, all by one deadline."""
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(policy.max_redirects + 1):
        location, body = _get(url, where, policy, deadline)
        if location is None:
            return body
        url = urljoin(url, location)
        match = _SCHEME.match(url)
        if not match or match.group(1).lower() not in ("http", "https"):
            raise MediaError(where, "redirected to a URL that is not http(s)")
    raise MediaError(where, f"more than {policy.max_redirects} redirects")


def _get(url: str, where: str, policy: MediaPolicy,
         deadline: float) -> tuple[str | None, bytes]:
    """One GET: a redirect's ``Location`` (and no body), or the body of a 2xx answer."""
    parts = urlsplit(url)
    host = _ascii_host(parts.hostname, where)
    https = parts.scheme.lower() == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError:
        raise MediaError(where, "URL has an invalid port") from None
    addresses = _checked_addresses(host, port, where, policy)
    conn = (_PinnedHTTPSConnection if https else _PinnedHTTPConnection)(
        host, port, addresses, deadline)
    # what http.client refuses to send (non-ASCII, spaces) percent-encoded, as browsers do
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                   safe=string.punctuation)
    response: http.client.HTTPResponse | None = None
    try:
        conn.request("GET", target, headers={
            "Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "quire"})
        response = conn.getresponse()
        location = response.getheader("Location")
        if response.status in _REDIRECTS and location:
            return location, b""
        if not 200 <= response.status < 300:
            raise MediaError(where, f"{host} answered HTTP {response.status} {response.reason}")
        return None, _read_body(response, where, policy)
    except TimeoutError:
        raise MediaError(where, f"fetch from {host} took over {policy.timeout_s} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise MediaError(where, f"fetch from {host} failed: {exc!r}") from None
    finally:
        if response is not None:
            response.close()
        conn.close()


def _ascii_host(hostname: str | None, where: str) -> str:
    """The URL's host name in ASCII (IDNA), as the Host header and DNS need it."""
    if not hostname:
        raise MediaError(where, "URL has no host")
    try:
        return hostname if hostname.isascii() else hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise MediaError(where, f"invalid host name {hostname!r}") from None


def _read_body(response: http.client.HTTPResponse, where: str, policy: MediaPolicy) -> bytes:
    """At most ``max_bytes`` of the body; refused when the server says or sends more."""
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > policy.max_bytes:
        raise MediaError(where, f"image is over {policy.max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(min(_CHUNK, policy.max_bytes + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > policy.max_bytes:
            raise MediaError(where, f"image is over {policy.max_bytes} bytes")
    return b"".join(chunks)


_Address = tuple[int, tuple]  # (family, sockaddr)


def _checked_addresses(host: str, port: int, where: str,
                       policy: MediaPolicy) -> list[_Address]:
    """Every address ``host`` resolves to, once; all must pass, or none is connected to.

    DNS is not bounded by the deadline: the stdlib resolver has no timeout.
    """
    allowed = {d.lower().rstrip(".") for d in policy.allowed_media_domains}
    trusted = host.lower().rstrip(".") in allowed
    if allowed and not trusted:
        raise MediaError(where, f"host {host!r} is not among the allowed media domains")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise MediaError(where, f"cannot resolve host {host!r}: {exc}") from None
    addresses = [(family, sockaddr) for family, _, _, _, sockaddr in infos
                 if family in (socket.AF_INET, socket.AF_INET6)]
    if not addresses:
        raise MediaError(where, f"host {host!r} has no IP address")
    for _, sockaddr in addresses:
        if not trusted and not _is_public(sockaddr[0]):
            raise MediaError(where, f"host {host!r} resolves to {sockaddr[0]}, which is not "
                                    "a public address (allow the host in allowed_media_domains)")
    return addresses


def _is_public(text: str) -> bool:
    """Whether an address is public: not loopback, private, link-local, multicast,
    reserved or unspecified, nor an IPv6 form carrying such an IPv4 address."""
    ip = ipaddress.ip_address(text.partition("%")[0])  # drop an IPv6 zone
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            candidates.append(embedded)
    return all(a.is_global and not (a.is_loopback or a.is_private or a.is_link_local
                                    or a.is_multicast or a.is_reserved or a.is_unspecified)
               for a in candidates)


def _time_left(deadline: float) -> float:
    """Seconds until ``deadline``; ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _open_socket(addresses: list[_Address], deadline: float) -> socket.socket:
    """A TCP socket connected to the first checked address that answers."""
    error: OSError = OSError("no address")
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_time_left(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError as exc:  # TimeoutError included
            sock.close()
            error = exc
    raise error


class _DeadlineSocket:
    """A connected socket whose every send and receive ends by one deadline: a timeout
    per call alone restarts with each byte a slow server trickles.

    Offers what ``http.client`` uses of a socket: ``sendall``, ``makefile``, ``close``;
    like a socket, it stays open while a file made from it is (the connection closes
    itself before its response's body is read).
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._files = 0
        self._closed = False

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(_time_left(self._deadline))
        self._sock.sendall(data)

    def recv_into(self, buffer: memoryview) -> int:
        self._sock.settimeout(_time_left(self._deadline))
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        self._files += 1
        return io.BufferedReader(_DeadlineReader(self))

    def release(self) -> None:
        """One file made by :meth:`makefile` is closed."""
        self._files -= 1
        self._close_when_unused()

    def close(self) -> None:
        self._closed = True
        self._close_when_unused()

    def _close_when_unused(self) -> None:
        if self._closed and self._files == 0:
            self._sock.close()


class _DeadlineReader(io.RawIOBase):
    """The raw reader ``makefile`` buffers: each read is one deadline-bound receive."""

    def __init__(self, sock: _DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock.release()
        super().close()


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to addresses already checked, while the request names the URL's host."""

    def __init__(self, host: str, port: int, addresses: list[_Address],
                 deadline: float) -> None:
        super().__init__(host, port)
        self._addresses = addresses
        self._deadline = deadline

    def connect(self) -> None:
        sock = self._wrap(_open_socket(self._addresses, self._deadline))
        self.sock = _DeadlineSocket(sock, self._deadline)

    def _wrap(self, sock: socket.socket) -> socket.socket:
        return sock


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """HTTPS the same way: TLS verifies the certificate for the URL's host (SNI too)."""

    default_port = 443

    def _wrap(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(_time_left(self._deadline))
        try:
            return _tls_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying client context, made on first https use (it loads the CA store)."""
    return ssl.create_default_context()
