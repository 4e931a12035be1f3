"""``GET /dashboard``: a live page of the server's metrics, for a person with a browser.

The page (``static/dashboard/``, package data) polls ``GET /metrics`` and parses the
Prometheus text in the browser, so it shows exactly what a scraper sees and the server
does no work for it beyond ``/metrics``; its charts are drawn by uPlot, vendored beside
it (``static/dashboard/README.md``). Nothing is fetched from elsewhere, which the
``Content-Security-Policy`` header enforces. Like ``/metrics`` (and vLLM's), the page
needs no API key: it shows figures, never requests or their text.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

#: The page's files and their media types; nothing else under the prefix is served.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
#: Everything from this server; uPlot sets inline styles on the elements it makes.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class Dashboard:
    """The page and its assets, read from the package once and served from memory."""

    def __init__(self) -> None:
        folder = resources.files("quire.entrypoints.server").joinpath("static", "dashboard")
        self.page_html = folder.joinpath("index.html").read_bytes()
        self.assets = {name: folder.joinpath(name).read_bytes() for name in ASSETS}

    async def page(self, request: Request) -> Response:
        return Response(self.page_html, media_type="text/html; charset=utf-8",
                        headers=_HEADERS)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = self.assets.get(name)
        if body is None:
            return Response(f"no dashboard file {name!r}\n", status_code=404,
                            media_type="text/plain")
        return Response(body, media_type=ASSETS[name], headers=_HEADERS)

    def routes(self) -> list[Route]:
        """``GET /dashboard`` and ``GET /dashboard/{name}`` (the page's relative links
        resolve there, so the page works under any path prefix a proxy adds)."""
        return [Route("/dashboard", self.page, methods=["GET"]),
                Route("/dashboard/{name}", self.asset, methods=["GET"])]
