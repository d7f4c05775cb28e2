"""`/dashboard`: the page that shows the fleet, served by every API server.

The page is the static files in this package (index.html, dashboard.js, dashboard.css): the
Python API servers read them from here, the Rust one compiles them in, so both serve the same
bytes. No build step: what is here is what the browser runs. The page itself holds no data, so
it is served without the API key; everything it shows comes from the routes it then calls,
which ask for the key where one is set (the page asks the user for it)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

from rankcast.api_server.errors import APIError

# Path under /dashboard -> (file in this package, content type).
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def read_assets() -> dict[str, tuple[bytes, str]]:
    """Every asset's bytes and content type, by its path under /dashboard."""
    package = resources.files(__name__)
    return {
        path: (package.joinpath(name).read_bytes(), content_type)
        for path, (name, content_type) in ASSETS.items()
    }


def add_dashboard_routes(app: FastAPI) -> None:
    assets = read_assets()  # a few tens of KiB, read once

    def asset(path: str) -> Response:
        found = assets.get(path)
        if found is None:
            raise APIError(404, f"no dashboard file {path!r}", None)
        body, content_type = found
        return Response(body, media_type=content_type, headers={"cache-control": "no-cache"})

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return asset("")

    @app.get("/dashboard/", include_in_schema=False)
    async def dashboard_slash() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard/{path}", include_in_schema=False)
    async def dashboard_file(path: str) -> Response:
        return asset(path)
