"""quire.multimodal.media: images from data, http(s) and file URLs, under a MediaPolicy.

HTTP runs against a local server on 127.0.0.1; names other than that are answered by a
fake resolver, so nothing leaves the host.
"""

from __future__ import annotations

import base64
import http.server
import io
import pickle
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image
from quire.multimodal import media
from quire.multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    load_image,
    load_image_base64,
)

WHERE = "messages[0].content[1].image_url"
LOCAL = MediaPolicy(allowed_media_domains=("127.0.0.1",))


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def _noise(size: int = 64) -> Image.Image:
    """An image that compresses badly, so a cut through it lands in pixel data."""
    return Image.frombytes("RGB", (size, size), random.Random(0).randbytes(size * size * 3))


PNG = _encode(Image.new("RGB", (8, 6), (255, 0, 0)), "PNG")


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A valid PNG declaring ``width`` x ``height`` 1-bit pixels, with a tiny IDAT: what a
    bomb looks like before its pixels are decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(bytes(1024))) + chunk(b"IEND", b""))


def _refused(url: str, policy: MediaPolicy, *fragments: str) -> MediaError:
    with pytest.raises(MediaError) as caught:
        load_image(url, WHERE, policy)
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return caught.value


# data URLs and decoding


def test_data_url_png_loads_as_rgb() -> None:
    image = load_image(_data_url(PNG), WHERE, MediaPolicy())
    assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (8, 6), (255, 0, 0))


def test_transparent_pixels_become_white() -> None:
    rgba = _encode(Image.new("RGBA", (4, 4), (0, 0, 0, 0)), "PNG")
    image = load_image(_data_url(rgba), WHERE, MediaPolicy())
    assert (image.mode, image.getpixel((1, 1))) == ("RGB", (255, 255, 255))


def test_grayscale_is_converted_to_rgb() -> None:
    gray = _encode(Image.new("L", (4, 4), 128), "JPEG")
    assert load_image(_data_url(gray, "image/jpeg"), WHERE, MediaPolicy()).mode == "RGB"


def test_invalid_base64_is_refused() -> None:
    _refused("data:image/png;base64,iVBOR!!not*base64", MediaPolicy(), "invalid base64")


@pytest.mark.parametrize("url, fragment", [
    ("data:text/plain;base64,aGVsbG8=", "must hold an image"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("data:image/png;base64", "must hold an image"),
])
def test_data_url_must_be_base64_image(url: str, fragment: str) -> None:
    _refused(url, MediaPolicy(), fragment)


def test_data_url_over_max_bytes_is_refused_before_decoding() -> None:
    _refused(_data_url(bytes(4096)), MediaPolicy(max_bytes=1024), "over 1024 bytes")


def test_bytes_that_are_not_an_image_are_refused() -> None:
    _refused(_data_url(b"<html>no image here</html>"), MediaPolicy(), "not an image")


def test_format_outside_the_policy_is_not_opened() -> None:
    policy = MediaPolicy(formats=("JPEG",))
    _refused(_data_url(PNG), policy, "not an image")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_refused(fmt: str) -> None:
    data = _encode(_noise(), fmt)
    with pytest.raises(MediaError, match="truncated"):
        decode_image(data[: len(data) // 2], WHERE, MediaPolicy())


def test_bomb_is_refused_from_its_header() -> None:
    # 9000 x 9000 is under PIL's own limit, so only the policy stands in the way; a
    # decode would have failed as truncated, so the message shows none was tried
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"9000x9000 pixels is over the limit"):
        decode_image(_png_header(9000, 9000), WHERE, MediaPolicy())
    assert time.monotonic() - started < 1


def test_bomb_past_pils_own_limit_is_a_media_error() -> None:
    with pytest.raises(MediaError, match="decompression bomb"):
        decode_image(_png_header(100_000, 100_000), WHERE, MediaPolicy())


def test_max_pixels_applies_to_modest_images() -> None:
    with pytest.raises(MediaError, match="over the limit of 100"):
        decode_image(_encode(_noise(16), "PNG"), WHERE, MediaPolicy(max_pixels=100))


def test_anthropic_base64_source() -> None:
    encoded = base64.b64encode(PNG).decode()
    assert load_image_base64(encoded, "image/png", WHERE, MediaPolicy()).size == (8, 6)
    assert load_image_base64(encoded, None, WHERE, MediaPolicy()).size == (8, 6)
    with pytest.raises(MediaError, match="media_type 'image/tiff'"):
        load_image_base64(encoded, "image/tiff", WHERE, MediaPolicy())
    with pytest.raises(MediaError, match="invalid base64"):
        load_image_base64("@@@@", "image/png", WHERE, MediaPolicy())


def test_unknown_scheme_is_named() -> None:
    _refused("ftp://example.com/cat.png", MediaPolicy(), "'ftp'")
    _refused("cat.png", MediaPolicy(), "unsupported URL scheme ''")


def test_media_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(MediaError(WHERE, "invalid base64")))
    assert (str(error), error.where) == (f"{WHERE}: invalid base64", WHERE)


@pytest.mark.parametrize("options", [
    {"max_bytes": 0}, {"timeout_s": 0}, {"max_pixels": -1}, {"max_redirects": -1},
    {"allowed_local_media_path": "/no/such/directory"}, {"allowed_media_domains": ("",)},
])
def test_policy_is_checked_when_created(options: dict) -> None:
    with pytest.raises(ValueError, match="MediaPolicy"):
        MediaPolicy(**options)


# http


@dataclass
class _Server:
    port: int
    #: The Host header of every request that reached the server.
    hosts: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    """Routes: ``/image.png``, ``/hop/N`` (N redirects, then the image), ``/to?url=U``,
    ``/missing``, ``/big``, ``/big-unsized``, ``/stall``, ``/trickle``."""

    server: http.server.ThreadingHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        state: _Server = self.server.state  # type: ignore[attr-defined]
        state.hosts.append(self.headers["Host"])
        parts = urlsplit(self.path)
        try:
            self._route(state, parts.path, parse_qs(parts.query))
        except OSError:  # the client gave up, as the timeout tests make it
            pass

    def _route(self, state: _Server, path: str, query: dict[str, list[str]]) -> None:
        if path == "/image.png" or path == "/hop/0":
            self._send(200, PNG)
        elif path.startswith("/hop/"):
            self._redirect(f"/hop/{int(path.rsplit('/', 1)[1]) - 1}")
        elif path == "/to":
            self._redirect(query["url"][0])
        elif path == "/big":
            self._send(200, bytes(4096))
        elif path == "/big-unsized":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0, no length: the body ends when the server closes
            self.wfile.write(bytes(4096))
        elif path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.flush()
            state.stop.wait(5)
        elif path == "/trickle":
            self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
            while not state.stop.wait(0.05):
                self.wfile.write(b"a")
                self.wfile.flush()
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def server() -> Iterator[_Server]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    state = _Server(port=httpd.server_address[1])
    httpd.state = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield state
    state.stop.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[str]]]:
    """Names ending in ``.test`` resolve to the lists of addresses put here, one list per
    lookup in turn; every other name goes to the real resolver."""
    answers: dict[str, list[list[str]]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list:
        if not host.endswith(".test"):
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6,
                 "", (ip, port, 0, 0) if ":" in ip else (ip, port))
                for ip in answers[host].pop(0)]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


def test_loopback_server_is_refused_by_default(server: _Server) -> None:
    _refused(server.url("/image.png"), MediaPolicy(), "127.0.0.1", "not a public address")
    assert server.hosts == []


def test_loopback_server_is_fetched_when_its_host_is_allowed(server: _Server) -> None:
    assert load_image(server.url("/image.png"), WHERE, LOCAL).size == (8, 6)


def test_other_hosts_are_refused_when_domains_are_listed(server: _Server) -> None:
    _refused(server.url("/image.png", host="localhost"), LOCAL, "'localhost'",
             "not among the allowed media domains")
    assert server.hosts == []


def test_connects_to_the_checked_address_and_sends_the_host_name(
        server: _Server, resolver: dict[str, list[list[str]]]) -> None:
    # a second lookup would answer elsewhere (DNS rebinding); there must be only one
    resolver["media.test"] = [["127.0.0.1"], ["10.9.9.9"]]
    policy = MediaPolicy(allowed_media_domains=("media.test",), timeout_s=2)
    assert load_image(server.url("/image.png", host="media.test"), WHERE, policy).size == (8, 6)
    assert server.hosts == [f"media.test:{server.port}"]
    assert resolver["media.test"] == [["10.9.9.9"]]


def test_every_resolved_address_is_checked(resolver: dict[str, list[list[str]]]) -> None:
    resolver["cdn.test"] = [["93.184.216.34", "127.0.0.1"]]
    _refused("http://cdn.test/cat.png", MediaPolicy(), "resolves to 127.0.0.1")


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "240.0.0.1", "255.255.255.255",
    "::1", "::", "fe80::1", "fc00::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "64:ff9b::a00:1", "2002:7f00:1::1",
])
def test_non_public_addresses_are_refused(address: str,
                                          resolver: dict[str, list[list[str]]]) -> None:
    resolver["evil.test"] = [[address]]
    _refused("https://evil.test/cat.png", MediaPolicy(), f"resolves to {address}")


def test_redirects_are_followed_up_to_the_limit(server: _Server) -> None:
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_redirects=3)
    assert load_image(server.url("/hop/3"), WHERE, policy).size == (8, 6)
    _refused(server.url("/hop/4"), policy, "more than 3 redirects")
    _refused(server.url("/hop/1"), MediaPolicy(allowed_media_domains=("127.0.0.1",),
                                               max_redirects=0), "more than 0 redirects")


@pytest.mark.parametrize("target", [
    "http://localhost.:{port}/image.png", "http://[::1]:{port}/image.png",
])
def test_redirect_to_a_host_not_allowed_is_refused(server: _Server, target: str) -> None:
    url = server.url("/to?url=" + target.format(port=server.port))
    _refused(url, LOCAL, "not among the allowed media domains")
    assert server.hosts == [f"127.0.0.1:{server.port}"]  # the target was never asked


def test_redirect_to_another_allowed_host_is_followed(
        server: _Server, resolver: dict[str, list[list[str]]]) -> None:
    resolver["store.test"] = [["127.0.0.1"]]
    url = server.url("/to?url=" + server.url("/image.png", host="store.test"))
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1", "store.test"))
    assert load_image(url, WHERE, policy).size == (8, 6)
    assert server.hosts == [f"127.0.0.1:{server.port}", f"store.test:{server.port}"]


def test_redirect_to_a_non_public_address_is_refused(
        server: _Server, resolver: dict[str, list[list[str]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # cdn.test stands for a public host: its checked address passes, and the connection
    # it would open reaches the local server instead, which redirects inward
    resolver["cdn.test"] = [["93.184.216.34"]]
    resolver["internal.test"] = [["10.0.0.7"]]
    real_open = media._open_socket
    monkeypatch.setattr(media, "_open_socket", lambda addresses, deadline: real_open(
        [(socket.AF_INET, ("127.0.0.1", server.port))], deadline))
    url = server.url("/to?url=http://internal.test/x.png", host="cdn.test")
    _refused(url, MediaPolicy(), "'internal.test' resolves to 10.0.0.7")
    assert server.hosts == [f"cdn.test:{server.port}"]


def test_redirect_to_a_file_url_is_refused(server: _Server, tmp_path: Path) -> None:
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",),
                         allowed_local_media_path=str(tmp_path))
    _refused(server.url(f"/to?url=file://{tmp_path}/x.png"), policy, "not http(s)")


def test_error_status_is_named(server: _Server) -> None:
    _refused(server.url("/missing"), LOCAL, "HTTP 404")


@pytest.mark.parametrize("path", ["/big", "/big-unsized"])
def test_response_over_max_bytes_is_refused(server: _Server, path: str) -> None:
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_bytes=1000)
    _refused(server.url(path), policy, "over 1000 bytes")


@pytest.mark.parametrize("path", ["/stall", "/trickle"])
def test_slow_server_is_cut_off_at_the_deadline(server: _Server, path: str) -> None:
    # /trickle sends a byte every 50 ms: a timeout per receive would never expire
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), timeout_s=0.5)
    started = time.monotonic()
    _refused(server.url(path), policy, "took over 0.5 s")
    assert time.monotonic() - started < 2


# file URLs


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


def test_file_url_is_refused_without_an_allowed_path(media_dir: Path) -> None:
    _refused((media_dir / "cat.png").as_uri(), MediaPolicy(), "no allowed local media path")


def test_file_url_under_the_allowed_path_loads(media_dir: Path) -> None:
    (media_dir / "alias.png").symlink_to(media_dir / "cat.png")
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    assert load_image((media_dir / "cat.png").as_uri(), WHERE, policy).size == (8, 6)
    assert load_image((media_dir / "alias.png").as_uri(), WHERE, policy).size == (8, 6)


def test_file_url_escaping_by_dotdot_is_refused(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    _refused(f"file://{media_dir}/../secret.png", policy, "outside the allowed")


def test_file_url_escaping_by_symlink_is_refused(media_dir: Path) -> None:
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    _refused((media_dir / "link.png").as_uri(), policy, "outside the allowed")


def test_file_url_missing_remote_or_oversized(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    _refused(f"file://{media_dir}/none.png", policy, "no such file")
    _refused(f"file://fileserver{media_dir}/cat.png", policy, "only local files")
    small = MediaPolicy(allowed_local_media_path=str(media_dir), max_bytes=10)
    _refused((media_dir / "cat.png").as_uri(), small, "over 10 bytes")


def test_a_thin_strip_is_refused_before_decoding():
    """A 1-pixel-high strip passes the pixel cap, but a processor scaling its short side
    up would make it huge: refused by its aspect ratio."""
    buf = io.BytesIO()
    Image.new("RGB", (1000, 2)).save(buf, format="PNG")
    with pytest.raises(MediaError, match="longer than 200 times"):
        decode_image(buf.getvalue(), "part", MediaPolicy())
    buf = io.BytesIO()
    Image.new("RGB", (400, 2)).save(buf, format="PNG")
    assert decode_image(buf.getvalue(), "part", MediaPolicy()).size == (400, 2)
