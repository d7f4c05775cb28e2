"""The OpenAPI document each kind of API server publishes at `/openapi.json`.

A Python API server builds it from its own routes (FastAPI); the Rust API server cannot, so it
serves a copy written here from the same routes (`rust/frontend/openapi.json`, embedded in its
binary): the Python document less the routes the Rust server does not serve, with a placeholder
for the one model-dependent value, the bound on token ids (the served vocabulary's size - 1),
which the Rust server fills in at start. Written as Starlette's `JSONResponse` writes the
Python one, so the two servers of a fleet answer the same bytes for the routes they share
(`tests/frontend_rust/test_mixed_fleet.py` checks it, so a route or schema changed on the Python
side without writing the copy again fails there).

    python -m rankcast.api_server.openapi_document     # after changing a route or its schema
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rankcast.api_server.app import build_app
from rankcast.api_server.drain import Drain
from rankcast.api_server.events import EventHub
from rankcast.api_server.metrics.prometheus import ServerMetrics
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.api_server.serving import ServingContext
from rankcast.engine_client.async_llm import AsyncLLM
from rankcast.engine_client.engine_views import EngineViews
from rankcast.tokenizer import ModelTokenizer, load_tokenizer

# vLLM's routes the Rust API server does not serve (a POST there is its 404).
RUST_UNSERVED = (
    "/collective_rpc",
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/pin_lora_adapter",
    "/v1/unpin_lora_adapter",
)
# Stands for the served vocabulary's last token id in the Rust server's copy.
VOCAB_PLACEHOLDER = 987654321
RUST_DOCUMENT = Path(__file__).resolve().parents[2] / "rust" / "frontend" / "openapi.json"


def python_document(config: ApiServerConfig, tokenizer: ModelTokenizer) -> dict[str, Any]:
    """What a Python API server with `config` publishes: its app built around an engine client
    that is never started (no route runs; the routes reach their engine only when called)."""
    views = EngineViews(1)
    metrics = ServerMetrics(config.model_name, 0, views)
    serving = ServingContext(
        AsyncLLM([], tokenizer, metrics, views=views),
        tokenizer,
        config.model_name,
        config.reasoning_parser,
        config.tool_call_parser,
    )
    app = build_app(config, 0, serving, metrics, EventHub(views), Drain(config.shutdown_timeout))
    return app.openapi()


def rust_document(python: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The Python document less the routes the Rust server lacks, each token-id bound (`vocab`
    - 1) replaced by the placeholder."""
    document: dict[str, Any] = json.loads(json.dumps(python))
    for path in RUST_UNSERVED:
        document["paths"].pop(path, None)

    def placeholder(node: Any) -> None:
        if isinstance(node, dict):
            items = node.get("items")
            if (
                node.get("type") == "array"
                and isinstance(items, dict)
                and items.get("maximum") == vocab - 1
                and items.get("minimum") == 0
            ):
                items["maximum"] = VOCAB_PLACEHOLDER
            for value in node.values():
                placeholder(value)
        elif isinstance(node, list):
            for value in node:
                placeholder(value)

    placeholder(document)
    return document


def rendered(document: dict[str, Any]) -> bytes:
    """The bytes Starlette's JSONResponse sends for `document`."""
    text = json.dumps(document, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


def main() -> None:
    from rankcast.model_files.source import resolve_model

    source = resolve_model(None)
    tokenizer = load_tokenizer(source.model_dir)
    config = ApiServerConfig("127.0.0.1", 0, "model", source.model_dir, "model")
    document = rust_document(python_document(config, tokenizer), len(tokenizer))
    RUST_DOCUMENT.write_bytes(rendered(document))
    print(f"wrote {RUST_DOCUMENT} ({len(document['paths'])} paths)")


if __name__ == "__main__":
    main()
