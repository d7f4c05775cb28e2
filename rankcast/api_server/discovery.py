"""What KV-aware routers ask a worker, in vLLM's shapes.

vllm-router (`kv_aware`), llm-d and Dynamo match a request against a worker's KV-cache events
by the request's token ids, which they ask the worker for (`/v1/chat/completions/render`,
`/v1/completions/render`): the ids must be those the engine will compute and cache, so these
routes run the same prompt construction the completion routes run. Discovery asks where the
events are published (`/kv_event_sources`) and the block size they are cut in
(`/get_server_info`), all read from the configuration the launcher handed this server.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from fastapi import FastAPI

from rankcast.api_server.schema import ChatCompletionRequest, CompletionRequest
from rankcast.api_server.server_config import ApiServerConfig
from rankcast.api_server.serving import (
    ServingContext,
    chat_prompt_ids,
    check_model,
    completion_prompt,
    live,
    sampling_params,
)
from rankcast.channel.vllm_kv_events import engine_sources
from rankcast.version import __version__


def _generate_request(
    request_id: str,
    token_ids: list[int],
    params: msgspec.Struct,
    model: str,
    stream: bool,
) -> dict[str, Any]:
    """vLLM's `GenerateRequest` answer: what a token-in engine would be sent."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": msgspec.to_builtins(params),
        "model": model,
        "stream": stream,
        "cache_salt": None,
        "priority": 0,
    }


def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> dict[str, Any]:
    check_model(ctx, body.model)
    structured, _ = ctx.shape(body)
    token_ids = chat_prompt_ids(ctx, body)
    top = body.top_logprobs or 0
    params = sampling_params(
        ctx, body, len(token_ids), body.output_limit(), top if body.logprobs else None, structured
    )
    model = body.model or ctx.model_name
    return _generate_request(
        f"chatcmpl-{uuid.uuid4().hex}", token_ids, params, model, bool(body.stream)
    )


def render_completion(ctx: ServingContext, body: CompletionRequest) -> list[dict[str, Any]]:
    check_model(ctx, body.model)
    structured, _ = ctx.shape(body)
    _, token_ids = completion_prompt(ctx, body)
    params = sampling_params(ctx, body, len(token_ids), body.max_tokens, body.logprobs, structured)
    model = body.model or ctx.model_name
    return [
        _generate_request(f"cmpl-{uuid.uuid4().hex}", token_ids, params, model, bool(body.stream))
    ]


def server_info(config: ApiServerConfig, max_model_len: int) -> dict[str, Any]:
    """The subset of vLLM's `vllm_config` (JSON form) that routers read."""
    events = config.kv_events_config
    return {
        "version": __version__,
        "vllm_config": {
            "model_config": {"model": config.model_name, "max_model_len": max_model_len},
            "cache_config": {
                "block_size": config.block_size,
                "enable_prefix_caching": config.enable_prefix_caching,
            },
            "parallel_config": {"data_parallel_size": config.data_parallel_size},
            "kv_events_config": None if events is None else msgspec.to_builtins(events),
            "speculative_config": None
            if config.speculative_config is None
            else msgspec.to_builtins(config.speculative_config),
        },
    }


def add_discovery_routes(app: FastAPI, config: ApiServerConfig, serving: ServingContext) -> None:
    @app.post("/v1/chat/completions/render")
    async def render_chat_route(body: ChatCompletionRequest) -> dict[str, Any]:
        return render_chat(live(serving), body)

    @app.post("/v1/completions/render")
    async def render_completion_route(body: CompletionRequest) -> list[dict[str, Any]]:
        return render_completion(live(serving), body)

    @app.get("/kv_event_sources")
    async def kv_event_sources_route() -> dict[str, dict[str, object]]:
        return engine_sources(config.kv_events_config, config.data_parallel_size)

    @app.get("/get_server_info")
    async def server_info_route() -> dict[str, Any]:
        return server_info(config, live(serving).engine.max_model_len)
