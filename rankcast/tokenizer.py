"""Tokenizer and chat template of a model directory, through transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rankcast.errors import ModelFormatError


def load_tokenizer(model_dir: Path) -> Any:
    """A fast tokenizer with the checkpoint's chat template."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelFormatError(f"{model_dir}: tokenizer files cannot be loaded ({exc})") from None


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render a conversation to prompt token ids; a model without a template is an error.
    `tools` (OpenAI's function definitions) reach templates that describe tools to the model;
    others ignore them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a plain completion prompt")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
        )
    except TemplateError as exc:  # the template refused the conversation (its own words)
        raise ValueError(f"the chat template refused the conversation: {exc}") from None
    # The template already wrote any BOS it wants; do not let encoding add a second one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
