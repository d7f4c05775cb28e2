"""What the launcher tells an API server (Python or Rust) about what to serve and where.

Kept apart from `api_server.py`, so that the launcher and the Rust server's wrapper can build it
without importing FastAPI, uvicorn and the rest of the Python server (~0.7 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ApiServerConfig:
    host: str
    port: int
    model_name: str
    model_dir: Path
    model_origin: str
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False
    shutdown_timeout: float = 30.0
