"""A model directory's tokenizer: its `tokenizer.json` through the tokenizers library, and its
chat template (rankcast.chat_template).

transformers' tokenizer class is the same tokenizers object with Python around it, but
importing transformers costs 1-2 s of every API server's and offline engine's start on a
2-core machine; this class reads the same files and does what transformers' fast tokenizer
does with them (its tests compare the two). Directories without a `tokenizer.json` (a
SentencePiece model only) are converted by transformers once, at load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from rankcast.errors import ModelFormatError

# The named special tokens a chat template sees (transformers' special_tokens_map).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# transformers' `clean_up_tokenization_spaces`, for WordPiece-style vocabularies that decode
# with a space before punctuation and contractions.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class ModelTokenizer:
    """Text to ids and back, and conversations to prompt ids, for one model."""

    def __init__(
        self,
        backend: Tokenizer,
        chat_template: str | Mapping[str, str] | None,
        special_tokens: Mapping[str, str],
        clean_up_spaces: bool = False,
    ) -> None:
        # Encoding a prompt never truncates or pads it (transformers turns both off per call).
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        # transformers ignores the clean-up for BPE models, whose spaces before punctuation
        # are real text.
        self.clean_up_spaces = clean_up_spaces and type(backend.model).__name__ != "BPE"

    def __len__(self) -> int:
        """The vocabulary with the added tokens: every id `decode` accepts is below it."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        if self.clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level pieces as the vocabulary spells them)."""
        return [str(self.backend.id_to_token(token_id)) for token_id in ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as prompt text; `variables`: more names the template sees (a
        request's `chat_template_kwargs`). ValueError when the model has no template or the
        template refuses the conversation (in the template's own words)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain completion prompt")
        # Imported on the first chat: jinja2 takes ~0.2 s to import on a small machine, which
        # an engine that only completes prompts need not pay at start.
        from jinja2 import TemplateError

        from rankcast.chat_template import pick_template, render_chat

        template = pick_template(self.chat_template, with_tools=tools is not None)
        try:
            return render_chat(
                template, messages, self.special_tokens, add_generation_prompt, tools, variables
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        except (TypeError, ArithmeticError, LookupError, AttributeError) as exc:
            # What a template does with values of a type it did not expect (a request's
            # chat_template_kwargs or message fields are the caller's data): the input's fault.
            raise ValueError(
                f"the chat template failed on this conversation: {type(exc).__name__}: {exc}"
            ) from None


def apply_chat_template(
    tokenizer: ModelTokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render a conversation to prompt token ids; a model without a template is an error.
    `tools` (OpenAI's function definitions) reach templates that describe tools to the model;
    others ignore them. `variables`: more names the template sees (`enable_thinking`)."""
    text = tokenizer.render_chat(messages, add_generation_prompt, tools, variables)
    # The template already wrote any BOS it wants; do not let encoding add a second one.
    return tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(model_dir: Path) -> ModelTokenizer:
    """The tokenizer of a model directory; ModelFormatError names the directory when its
    tokenizer files cannot be read."""
    try:
        if (model_dir / "tokenizer.json").exists():
            return _from_files(model_dir)
        return _converted_by_transformers(model_dir)
    except ModelFormatError:
        raise
    except Exception as exc:
        raise ModelFormatError(f"{model_dir}: tokenizer files cannot be loaded ({exc})") from None


def load_hf_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer for the same directory, for libraries that accept only that
    (xgrammar's TokenizerInfo); imported on first use, never on the serving path's start."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _chat_templates(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """Where transformers looks, in its order: `chat_template.jinja` and the named templates
    in `additional_chat_templates/` take priority over tokenizer_config.json's entry (a string,
    or a list of {name, template})."""
    files: dict[str, str] = {}
    single = model_dir / "chat_template.jinja"
    if single.is_file():
        files["default"] = single.read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    entry = config.get("chat_template")
    if isinstance(entry, list):
        return {item["name"]: item["template"] for item in entry}
    return entry if isinstance(entry, str) else None


def _from_files(model_dir: Path) -> ModelTokenizer:
    path = model_dir / "tokenizer.json"
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelFormatError(f"{path}: cannot be loaded by tokenizers ({exc})") from None
    config = _read_json(model_dir / "tokenizer_config.json")
    # Tokens the config declares that tokenizer.json lacks are added, as transformers does.
    for entry in (config.get("added_tokens_decoder") or {}).values():
        content = entry.get("content") if isinstance(entry, dict) else None
        if isinstance(content, str) and backend.token_to_id(content) is None:
            token = AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
    legacy = _read_json(model_dir / "special_tokens_map.json")
    special: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name, legacy.get(name)))
        if text is not None:
            special[name] = text
    return ModelTokenizer(
        backend,
        _chat_templates(model_dir, config),
        special,
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def _converted_by_transformers(model_dir: Path) -> ModelTokenizer:
    hf = load_hf_tokenizer(model_dir)
    return ModelTokenizer(
        hf.backend_tokenizer,
        hf.chat_template,
        hf.special_tokens_map,
        clean_up_spaces=bool(getattr(hf, "clean_up_tokenization_spaces", False)),
    )
