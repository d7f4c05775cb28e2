"""`/tokenize` and `/detokenize`: the server's tokenizer, in vLLM's request and response shapes,
so a client can count or inspect tokens exactly as the engine will see them."""

from __future__ import annotations

from typing import Any

from rankcast.api_server.errors import APIError
from rankcast.api_server.schema import DetokenizeRequest, TokenizeRequest
from rankcast.api_server.serving import ServingContext, check_model


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict[str, Any]:
    """The prompt's token ids as a completion (or, with `messages`, a chat completion) of the
    same request would give them to the engine; an adapter shares the base model's tokenizer."""
    check_model(ctx, body.model)
    if body.messages is not None:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = ctx.tokenizer.render_chat(
                messages, body.add_generation_prompt, variables=body.chat_template_kwargs
            )
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        # The rendered text encoded as a completion prompt would be, special tokens on request.
        tokens = ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = ctx.tokenizer.encode(body.prompt or "", add_special_tokens=special)
    return {
        "count": len(tokens),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": tokens,
        "token_strs": ctx.tokenizer.token_strings(tokens) if body.return_token_strs else None,
    }


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict[str, Any]:
    check_model(ctx, body.model)
    vocab = len(ctx.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
