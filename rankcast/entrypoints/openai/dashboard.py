"""`/dashboard`: the page that shows the fleet (rankcast/dashboard/). The page itself holds no
data, so it is served without the API key; everything it shows comes from the routes it then
calls, which ask for the key where one is set (the page asks the user for it)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

from rankcast.dashboard import read_assets
from rankcast.entrypoints.openai.errors import APIError


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
