"""The dashboard's static files (index.html, dashboard.js, dashboard.css), served at `/dashboard`
by every API server: the Python ones read them from this package, the Rust one compiles them in,
so both serve the same bytes. No build step: what is here is what the browser runs."""

from __future__ import annotations

from importlib import resources

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
