"""What the launcher tells an API server (Python or Rust) about what to serve and where.

Kept apart from `api_server.py`, so that the launcher and the Rust server's wrapper can build it
without importing FastAPI, uvicorn and the rest of the Python server (~0.7 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rankcast.config import KVEventsConfig, SpeculativeConfig


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
    # What routers' discovery asks a worker (`/get_server_info`, `/kv_event_sources`).
    block_size: int = 16
    enable_prefix_caching: bool = True
    data_parallel_size: int = 1
    kv_events_config: KVEventsConfig | None = None
    routing_policy: str = "load"
    # Adapters each engine's host tier holds (--max-cpu-loras), which the router keeps a
    # request from overfilling; None without LoRA.
    lora_host_places: int | None = None
    # How chat outputs are read (--reasoning-parser; --tool-call-parser when
    # --enable-auto-tool-choice is on): api_server/output_parsers.py.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # Speculative decoding as the engines run it (`/get_server_info` names the method).
    speculative_config: SpeculativeConfig | None = None
