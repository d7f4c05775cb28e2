"""One API server process: a FastAPI app under uvicorn, sharing the port with its siblings.

Each API server has its own connection to the engine core, its own output processor and its own
metrics registry; everything engine-derived it reports comes from what the engine core
broadcasts, so all siblings behind the port agree.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from rankcast.addresses import ClientAddresses
from rankcast.api_server.anthropic_messages import add_messages_routes
from rankcast.api_server.dashboard import add_dashboard_routes
from rankcast.api_server.discovery import add_discovery_routes
from rankcast.api_server.drain import (
    RETRY_AFTER_S,
    Drain,
    DrainGate,
    DrainingServer,
    ServerShuttingDownError,
)
from rankcast.api_server.errors import ANTHROPIC_PREFIX, APIError, error_response
from rankcast.api_server.events import EventFilter, EventHub, parse_event_id
from rankcast.api_server.metrics.lora_metrics import LoRAMetrics
from rankcast.api_server.metrics.prometheus import ServerMetrics
from rankcast.api_server.middleware import CountRequests, LastResortErrors, TagAndAuthenticate
from rankcast.api_server.openai_responses import add_responses_routes
from rankcast.api_server.schema import (
    ChatCompletionRequest,
    CollectiveRpcRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    PinLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.api_server.serving import (
    ServingContext,
    create_chat_completion,
    create_completion,
    live,
)
from rankcast.api_server.tokenization import detokenize, tokenize
from rankcast.engine_client.async_llm import AsyncLLM, NotificationSink
from rankcast.engine_client.engine_router import EngineRouter
from rankcast.engine_client.engine_views import EngineViews
from rankcast.engine_client.mp_client import AsyncMPClient, EngineDeadError, UtilityError
from rankcast.logger import init_logging
from rankcast.outputs import RequestRejectedError
from rankcast.process import die_with_parent, set_process_title
from rankcast.protocol import (
    AddLoRA,
    CollectiveRPC,
    ErrorKind,
    LoRAAdapterInfo,
    PinLoRA,
    RemoveLoRA,
    ResetPrefixCache,
)
from rankcast.start_up_holds import hold_here
from rankcast.startup_gc import freeze_startup_heap
from rankcast.supervisor_state import read_state
from rankcast.tokenizer import load_tokenizer
from rankcast.version import __version__

logger = logging.getLogger(__name__)


# The parts of a validation error's location that name a union's alternative (`str`,
# `list[TextBlock]`, `UserMessage`), not a field: dropped, so the location reads as the body's
# path. Field names are lower-case.
_UNION_ALTERNATIVE = re.compile(
    r"^(str|int|float|bool|none|constrained-\w+|[a-z-]+\[.*\]|[A-Z][A-Za-z0-9]*)$"
)


def _body_path(loc: tuple[Any, ...], body: Any) -> list[str]:
    """`loc` as a path into the request body: union alternatives dropped, and a tagged
    union's tag (pydantic names the alternative by the value of its `type` or `role`, which
    is no key of the object) dropped once per object."""
    path: list[str] = []
    node, tag_dropped = body, False
    for part in loc:
        if part == "body" or (isinstance(part, str) and _UNION_ALTERNATIVE.match(part)):
            continue
        is_key = isinstance(node, dict) and part in node
        if isinstance(node, dict) and not is_key and not tag_dropped and part in node.values():
            tag_dropped = True
            continue
        path.append(str(part))
        is_index = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        node, tag_dropped = (node[part] if is_key or is_index else None), False
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message of a 400 for a body that failed validation, and the field it names first.
    Of the alternatives of a union the deepest failure is named (an image block in a message
    is a bad block, not "should be a string")."""
    found: list[tuple[str, str]] = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return f"Invalid JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        location = ".".join(_body_path(tuple(error.get("loc", ())), exc.body))
        found.append((location, str(error.get("msg")).removeprefix("Value error, ")))
    deeper = [
        (location, message)
        for location, message in found
        if not (location and any(other.startswith(f"{location}.") for other, _ in found))
    ]
    parts = [f"{location}: {message}" if location else message for location, message in deeper]
    param = next((location for location, _ in deeper if location), None)
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def build_app(
    config: ApiServerConfig,
    index: int,
    serving: ServingContext,
    metrics: ServerMetrics,
    events: EventHub,
    drain: Drain,
) -> FastAPI:
    """The HTTP surface over an engine connection that is already established."""
    app = FastAPI(title="rankcast", version=__version__)
    # The later one added is the outer one: the last resort's 500 and a draining server's 503
    # are tagged like any answer, and every answer is counted.
    app.add_middleware(LastResortErrors)
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(TagAndAuthenticate, index=index, api_key=config.api_key)
    app.add_middleware(CountRequests, metrics=metrics)
    _add_error_handlers(app)
    _add_probe_routes(app, serving, metrics)
    _add_model_routes(app, config, serving)
    _add_prefix_cache_routes(app, serving)
    _add_lora_routes(app, serving, config.allow_runtime_lora_updating, config.model_name)
    _add_event_routes(app, events)
    _add_collective_rpc_route(app, serving)
    _add_completion_routes(app, serving)
    add_responses_routes(app, serving)
    add_messages_routes(app, serving)
    add_discovery_routes(app, config, serving)
    add_dashboard_routes(app)
    _document_errors_as_answered(app, len(serving.tokenizer))
    return app


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _bound_token_ids(node: Any, vocab: int) -> None:
    """Every token-id array of the schema (`TokenId` items) gets the vocabulary's bound, which
    only the running server knows: an id past it is a 400, and the schema says so."""
    if isinstance(node, dict):
        items = node.get("items")
        if node.get("type") == "array" and items == {"minimum": 0, "type": "integer"}:
            items["maximum"] = vocab - 1
        for value in node.values():
            _bound_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab)


def _document_errors_as_answered(app: FastAPI, vocab: int) -> None:
    """The OpenAPI schema says what the server does: a body that fails validation is a 400 in
    the error shape of the route's API (OpenAI's, or Anthropic's under /v1/messages: what each
    API answers and its clients expect), not FastAPI's 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for route, path in schema.get("paths", {}).items():
                shape = _ERROR_SCHEMA
                if route.startswith(ANTHROPIC_PREFIX):
                    shape = _ANTHROPIC_ERROR_SCHEMA
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {
                            "description": "Invalid request: the message names the field",
                            "content": {"application/json": {"schema": shape}},
                        }
            _bound_token_ids(schema, vocab)
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in its API's error shape (`error_response`), whatever raised it."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail), path=request.url.path)
        # A 405 says which methods the route takes (`Allow`), as HTTP asks.
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestRejectedError)
    async def request_rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return error_response(400, str(exc), path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        message = f"The engine core is not running: {exc}"
        return error_response(503, message, path=request.url.path)

    @app.exception_handler(ServerShuttingDownError)
    async def shutting_down(request: Request, exc: ServerShuttingDownError) -> JSONResponse:
        response = error_response(503, str(exc), path=request.url.path)
        response.headers["retry-after"] = str(RETRY_AFTER_S)
        return response


def _add_probe_routes(app: FastAPI, serving: ServingContext, metrics: ServerMetrics) -> None:
    """What load balancers and scrapers ask: /health (503 once the engine died), vLLM's /ping
    and /load, /version, /metrics."""

    fleet_started = False  # once the launcher says so, for good: no file read after that

    @app.get("/health")
    async def health() -> Response:
        """200 while any engine core serves (a dead data-parallel sibling is named in the
        body), 503 once none does. A dead engine's entry says whether the launcher is
        restarting it or has given up, and why; `incarnation` counts the engine core's
        restarts (its events' ids carry it). Under `rankcast serve`, also 503 until the
        whole fleet has started (every API server ready once; the body's `fleet` says how
        far it is): a load balancer must not take the first API server up for a fleet that
        can serve what it was started for."""
        nonlocal fleet_started
        health = serving.engine.engine_health()
        supervisor = None
        if not fleet_started or any(why for _, why in health):
            supervisor = read_state()
        if supervisor is None or supervisor.fleet.state == "serving":
            fleet_started = True
        states = {} if supervisor is None else {s.engine: s for s in supervisor.engines}
        engines = []
        for index, why in health:
            entry: dict[str, object] = {
                "engine": index,
                "up": why is None,
                "incarnation": serving.engine.views[index].incarnation,
            }
            if why is not None:
                entry["error"] = why
                state = states.get(index)
                if state is not None and state.state != "serving":
                    entry["supervisor"] = {"state": state.state, "message": state.message}
            engines.append(entry)
        body: dict[str, object] = {"engines": engines}
        status = 503 if serving.engine.dead is not None else 200
        if not fleet_started and supervisor is not None:
            body["fleet"] = msgspec.structs.asdict(supervisor.fleet)
            status = 503
        response = JSONResponse(body, status_code=status)
        if "fleet" in body:
            response.headers["retry-after"] = str(RETRY_AFTER_S)
        return response

    # One route per method: a route of two methods names its operations and its `Allow` in
    # the order of a set of strings, which differs between processes (hash randomisation), so
    # two servers of a fleet would publish different schemas.
    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's (SageMaker's) probe: /health's status, no body."""
        return Response(status_code=(await health()).status_code)

    @app.post("/ping")
    async def ping_post() -> Response:
        """The same probe by POST, as vLLM takes it."""
        return await ping()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the completions in flight on this API server."""
        return {"server_load": len(serving.engine.streams)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _add_model_routes(app: FastAPI, config: ApiServerConfig, serving: ServingContext) -> None:
    """/v1/models: the base model, then every registered adapter as a model of its own."""

    def cards() -> list[dict[str, object]]:
        ctx = live(serving)
        base: dict[str, object] = {
            "id": config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "rankcast",
            "root": config.model_origin,
            "parent": None,
            "max_model_len": ctx.engine.max_model_len,
        }
        adapters = [
            {**base, "id": name, "root": name, "parent": config.model_name}
            for name in ctx.engine.views.adapter_names()
        ]
        return [base, *adapters]

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, object]:
        """One model by id, as OpenAI's retrieve call asks (an adapter is a model too)."""
        for card in cards():
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")


def _add_prefix_cache_routes(app: FastAPI, serving: ServingContext) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget every engine's cached prefix blocks (409 while requests hold blocks)."""
        done = await live(serving).engine.call(ResetPrefixCache())
        status = 200 if all(done) else 409
        return JSONResponse({"reset": done}, status_code=status)


def _add_lora_routes(
    app: FastAPI, serving: ServingContext, allow_updating: bool, base_model: str
) -> None:
    """/v1/lora_adapters always; loading, unloading and pinning only when the operator allowed
    runtime updates (--allow-runtime-lora-updating), since they change what every client gets."""

    @app.get("/v1/lora_adapters")
    async def lora_adapters() -> dict[str, object]:
        """Adapter residency per engine and rank, as every API server sees it."""
        ctx = live(serving)
        return {"data": ctx.engine.views.describe_adapters()}

    @app.get("/v1/engine_views")
    async def engine_views() -> dict[str, object]:
        """Every engine as this API server's view has it (what the dashboard renders): adapters
        per rank and tier, pins, event counts, incarnation, the KV index's size."""
        return {"object": "list", "data": live(serving).engine.views.as_json()}

    if allow_updating:
        _add_lora_update_routes(app, serving, base_model)


# The HTTP status of a failed engine utility, by the kind the engine gave its error (never by
# its text). `internal` is the engine's own bug: a 500, its traceback in the engine's log.
UTILITY_ERROR_STATUS: dict[ErrorKind, int] = {
    ErrorKind.BAD_ARGUMENT: 400,
    ErrorKind.UNKNOWN_ADAPTER: 404,
    ErrorKind.NO_CAPACITY: 409,
    ErrorKind.ADAPTER_BUSY: 409,
    ErrorKind.ADAPTER_EXISTS: 409,
    ErrorKind.UNKNOWN_METHOD: 404,
    ErrorKind.EXTENSION_FAILED: 400,
    ErrorKind.INTERNAL: 500,
}


def _utility_error(exc: UtilityError, param: str) -> APIError:
    return APIError(UTILITY_ERROR_STATUS[exc.kind], str(exc), param)


def _adapters_json(adapters: list[LoRAAdapterInfo]) -> list[dict[str, object]]:
    return [msgspec.structs.asdict(a) for a in adapters]


def _add_lora_update_routes(app: FastAPI, serving: ServingContext, base_model: str) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, object]:
        if body.lora_name == base_model:
            # `model` picks the base model by this name: an adapter under it could never be used.
            raise APIError(
                400,
                f"{body.lora_name!r} is the name of the base model this server serves; "
                "give the adapter a name of its own",
                "lora_name",
            )
        try:
            loaded = await live(serving).engine.call(AddLoRA(body.lora_name, body.lora_path))
        except UtilityError as exc:
            raise _utility_error(exc, "lora_path") from None
        return {"object": "lora_adapter", "data": _adapters_json(loaded)}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, object]:
        try:
            await live(serving).engine.call(RemoveLoRA(body.lora_name))
        except UtilityError as exc:
            raise _utility_error(exc, "lora_name") from None
        return {"object": "lora_adapter", "name": body.lora_name, "unloaded": True}

    async def set_pinned(name: str, pinned: bool) -> dict[str, object]:
        """`data`: the adapter as each engine core holds it, in engine order."""
        try:
            adapters = await live(serving).engine.call(PinLoRA(name, pinned))
        except UtilityError as exc:
            raise _utility_error(exc, "lora_name") from None
        return {"object": "lora_adapter", "data": _adapters_json(adapters)}

    @app.post("/v1/pin_lora_adapter")
    async def pin_lora_adapter(body: PinLoRAAdapterRequest) -> dict[str, object]:
        """Keep an adapter in the device tier (loading it there now) until unpinned."""
        return await set_pinned(body.lora_name, True)

    @app.post("/v1/unpin_lora_adapter")
    async def unpin_lora_adapter(body: PinLoRAAdapterRequest) -> dict[str, object]:
        return await set_pinned(body.lora_name, False)


def _add_event_routes(app: FastAPI, events: EventHub) -> None:
    @app.get("/v1/events")
    async def notification_events(
        request: Request,
        type: str | None = None,
        key: str | None = None,
        last_event_id: str | None = None,
    ) -> StreamingResponse:
        """Engine notifications as server-sent events; `type`/`key` filter (comma-separated),
        `Last-Event-ID` (header or query) resumes."""
        resume = request.headers.get("last-event-id") or last_event_id
        if resume is not None:
            try:
                parse_event_id(resume)
            except ValueError as exc:
                raise APIError(400, str(exc), "last_event_id") from None
        return StreamingResponse(
            events.stream(EventFilter.parse(type, key), resume),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )


def _add_collective_rpc_route(app: FastAPI, serving: ServingContext) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> dict[str, object]:
        """Call a --worker-extension-cls method on every rank of every engine core."""
        try:
            call = CollectiveRPC(body.method, body.args, body.timeout)
            results = await live(serving).engine.call(call)
        except UtilityError as exc:
            raise _utility_error(exc, "method") from None
        return {"results": msgspec.to_builtins(results)}


def _add_completion_routes(app: FastAPI, serving: ServingContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(live(serving), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(live(serving), body, request)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, object]:
        return tokenize(live(serving), body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, object]:
        return detokenize(live(serving), body)


def bind_shared_port(host: str, port: int) -> socket.socket:
    """A listening socket that sibling API servers also bind; the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def run_api_server(
    config: ApiServerConfig, index: int, engines: list[ClientAddresses], ready: Connection
) -> None:
    """Process entry point: serve until SIGTERM/SIGINT (uvicorn shuts down gracefully).

    The port is bound only after the engine handshake succeeded, so the kernel never hands a
    connection to a sibling that cannot answer yet.
    """
    role = f"api_server_{index}"
    set_process_title(role)
    init_logging(role)
    die_with_parent()

    async def serve() -> None:
        views = EngineViews(len(engines))
        metrics = ServerMetrics(config.model_name, index, views)
        events = EventHub(views)
        metrics.lora = LoRAMetrics(metrics.registry, metrics.fleet, config.model_name, views)
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model_dir)
        clients = [AsyncMPClient(addresses, index) for addresses in engines]
        sinks: list[NotificationSink] = [metrics, events]
        router = EngineRouter(
            views, config.routing_policy, config.block_size, config.lora_host_places
        )
        engine = AsyncLLM(clients, tokenizer, metrics, sinks=sinks, router=router, views=views)
        try:
            await engine.start()
        except Exception as exc:
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        hold_here("handshaken")  # a fault test's moment: engines answered, the port not yet bound
        drain = Drain(config.shutdown_timeout)
        app = build_app(
            config,
            index,
            ServingContext(
                engine,
                tokenizer,
                config.model_name,
                config.reasoning_parser,
                config.tool_call_parser,
            ),
            metrics,
            events,
            drain,
        )
        server = DrainingServer(
            uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5),
            drain,
        )
        sock = bind_shared_port(config.host, config.port)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        freeze_startup_heap()  # rankcast/startup_gc.py
        ready.send(("ready",) if server.started else ("error", "uvicorn did not start"))

        async def drain_then_exit() -> None:
            while not drain.requested and not server.should_exit:
                await asyncio.sleep(0.05)
            if not server.should_exit:

                def end_the_rest() -> None:
                    engine.fail_all(
                        ServerShuttingDownError(
                            f"The server is shutting down; the request did not finish within "
                            f"--shutdown-timeout ({config.shutdown_timeout:g} s)."
                        )
                    )

                await drain.run(end_the_rest, events.close)
            events.close()
            server.should_exit = True

        watcher = asyncio.create_task(drain_then_exit())
        try:
            await task
        finally:
            watcher.cancel()
            engine.shutdown()

    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        runner.run(serve())


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed: the API server's loop handles every streamed token, and
    uvloop (with uvicorn's httptools parser, picked up by itself) roughly halves its cost."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
