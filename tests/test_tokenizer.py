"""rankcast's tokenizer (tokenizers + jinja2, rankcast/tokenizer.py and chat_template.py) against
transformers' fast tokenizer on the same directory: ids with and without special tokens, decodes,
token strings, vocabulary size and special tokens on the embedded model and on random text; chat
prompts on the embedded model's template and on templates that use every part of transformers'
template environment (namespace, loop controls, generation blocks, tojson's options, dict(),
raise_exception, tools, reasoning fields, named templates); the sandbox's refusals; and the
start-up point of it all: neither the tokenizer nor an offline engine imports transformers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rankcast.errors import ModelFormatError
from rankcast.tokenizer import ModelTokenizer, apply_chat_template, load_tokenizer
from tests.test_tokenizer_rust import CORPUS

REPO = Path(__file__).resolve().parent.parent

# The Rust tokenizer's corpus (unicode, emoji, whitespace runs, digits, special tokens) and a
# text that transformers' space clean-up would change.
TEXTS = [*CORPUS, "Hello , world . It 's done"]

# Conversations with what OpenAI clients send: None values beside tool calls, extra keys,
# reasoning under its three names, non-ASCII and HTML-significant characters.
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in <b>one</b> word & be brief."},
        {"role": "user", "content": "Capital of Perú?"},
        {"role": "assistant", "content": "Lima", "reasoning_content": "It is Lima."},
        {"role": "user", "content": "And Chile?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
            "thinking": "call the tool",
        },
        {"role": "tool", "content": "18 °C", "tool_call_id": "call_1", "name": None},
    ],
    [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "user"}],
    [
        {"role": "user", "content": "first"},
        {"role": "stop", "content": "here"},
        {"role": "user", "content": "never seen", "reasoning": "r"},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather in a city («quoted»)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# Every part of transformers' template environment that a checkpoint's template may use.
FEATURE_TEMPLATE = """{{ bos_token }}{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
<{{ message.role }}>
    {% if message.reasoning_content is defined %}
[{{ message.reasoning_content }}|{{ message.thinking }}]
    {% endif %}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
    {% else %}
{{ message.content }}
    {% endif %}
    {% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
    {% if message.content is defined and message.content is none %}NONE{% endif %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2) }}{{ tools | tojson(ensure_ascii=true) }}{% endif %}
{{ dict(turns=ns.count, docs=documents is none) | tojson(sort_keys=True, separators=(',', ':')) }}
{{ dict.fromkeys(['x', 'y'], 0) | tojson }}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}{{ unk_token }}"""


def _hf(model_dir: Path) -> Any:
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def _hf_chat(hf: Any, messages: list[dict[str, Any]], add: bool, tools: Any = None) -> str:
    return str(
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, tools=tools)
    )


def _model_with(
    tmp_path: Path,
    source: Path,
    config: dict[str, Any],
    edit_tokenizer: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A tokenizer directory: the embedded model's tokenizer.json (optionally edited) and the
    given tokenizer_config.json."""
    out = tmp_path / "tok"
    out.mkdir()
    data = json.loads((source / "tokenizer.json").read_text())
    if edit_tokenizer is not None:
        edit_tokenizer(data)
    (out / "tokenizer.json").write_text(json.dumps(data))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def ours(embedded_model_dir: Path) -> ModelTokenizer:
    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def hf(embedded_model_dir: Path) -> Any:
    return _hf(embedded_model_dir)


def test_the_embedded_models_ids_decodes_and_vocabulary_equal_transformers(
    ours: ModelTokenizer, hf: Any
) -> None:
    assert len(ours) == len(hf)
    assert ours.special_tokens == hf.special_tokens_map
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf(text, add_special_tokens=special)["input_ids"], repr(text)
        assert ours.token_strings(ids) == hf.convert_ids_to_tokens(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=80))
def test_any_text_encodes_and_decodes_as_transformers_does(
    ours: ModelTokenizer, hf: Any, text: str
) -> None:
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids)


def test_the_embedded_models_chat_prompts_equal_transformers(ours: ModelTokenizer, hf: Any) -> None:
    for messages in CONVERSATIONS[:2]:
        for add in (True, False):
            want = _hf_chat(hf, messages, add, TOOLS)
            assert ours.render_chat(messages, add, TOOLS) == want
            assert (
                apply_chat_template(ours, messages, add)
                == hf(want, add_special_tokens=False)["input_ids"]
            )
    # A tool call without content: this template concatenates the missing content and fails
    # in both, as a ValueError here (the API server's 400).
    with pytest.raises(jinja2.TemplateError):
        _hf_chat(hf, CONVERSATIONS[2], True)
    with pytest.raises(ValueError, match=r"refused the conversation: .* no attribute 'content'"):
        ours.render_chat(CONVERSATIONS[2])


def test_every_template_feature_renders_as_transformers_renders_it(
    tmp_path: Path, embedded_model_dir: Path
) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": FEATURE_TEMPLATE,
    }
    model_dir = _model_with(tmp_path, embedded_model_dir, config)
    ours, hf = load_tokenizer(model_dir), _hf(model_dir)
    assert ours.special_tokens == hf.special_tokens_map
    rendered = set()
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for add in (True, False):
                want = _hf_chat(hf, messages, add, tools)
                assert ours.render_chat(messages, add, tools) == want
                rendered.add(want)
    # The template's branches did fire: reasoning aliases, no "None", unescaped JSON.
    joined = "\n".join(rendered)
    assert "[It is Lima.|It is Lima.]" in joined and "[call the tool|call the tool]" in joined
    assert "None" not in joined and "NONE" not in joined
    assert '"Today\'s weather in a city («quoted»)"' in joined and "\\u00ab" in joined
    assert "never seen" not in joined and '{"docs":true,"turns":2}' in joined


def test_a_templates_refusal_and_the_sandbox_are_value_errors(
    tmp_path: Path, embedded_model_dir: Path
) -> None:
    model_dir = _model_with(tmp_path, embedded_model_dir, {"chat_template": FEATURE_TEMPLATE})
    ours = load_tokenizer(model_dir)
    wrong_order = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ValueError, match="refused the conversation: the system message must"):
        ours.render_chat(wrong_order)
    with pytest.raises(ValueError, match="the conversation is empty"):
        ours.render_chat([])
    escapes = {
        "underscore namespace": "{% set ns = namespace(_hidden=1) %}x",
        "mutating an input": "{{ messages.append(1) }}",
        "interpreter internals": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    }
    for name, source in escapes.items():
        ours.chat_template = source
        with pytest.raises(ValueError, match="refused the conversation"):
            ours.render_chat([{"role": "user", "content": "x"}])
            pytest.fail(name)


def test_named_templates_pick_tool_use_when_there_are_tools(
    tmp_path: Path, embedded_model_dir: Path
) -> None:
    named = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}"},
    ]
    in_config = _model_with(tmp_path, embedded_model_dir, {"chat_template": named})
    as_files = tmp_path / "files"
    shutil.copytree(in_config, as_files)
    (as_files / "chat_template.jinja").write_text("J:{{ messages[0].content }}")
    (as_files / "additional_chat_templates").mkdir()
    (as_files / "additional_chat_templates" / "tool_use.jinja").write_text("F:{{ tools|length }}")
    hello = [{"role": "user", "content": "hi"}]
    for model_dir, plain, with_tools in ((in_config, "D:hi", "T:1"), (as_files, "J:hi", "F:1")):
        ours, hf = load_tokenizer(model_dir), _hf(model_dir)
        assert ours.render_chat(hello) == _hf_chat(hf, hello, True) == plain
        assert ours.render_chat(hello, tools=TOOLS) == _hf_chat(hf, hello, True, TOOLS)
        assert ours.render_chat(hello, tools=TOOLS) == with_tools
    (in_config / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[1:]}))
    with pytest.raises(ValueError, match="none is named 'default'"):
        load_tokenizer(in_config).render_chat(hello)
    (in_config / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no chat template"):
        load_tokenizer(in_config).render_chat(hello)


def test_the_configs_added_tokens_and_the_files_truncation_are_as_transformers_has_them(
    tmp_path: Path, embedded_model_dir: Path
) -> None:
    def truncate_to_three(data: dict[str, Any]) -> None:
        data["truncation"] = {
            "direction": "Right",
            "max_length": 3,
            "strategy": "LongestFirst",
            "stride": 0,
        }

    config = {
        "added_tokens_decoder": {
            "49152": {"content": "<|newtok|>", "special": True},
            "49153": {"content": "plainword", "special": False, "normalized": True},
        },
        "clean_up_tokenization_spaces": True,
    }
    model_dir = _model_with(tmp_path, embedded_model_dir, config, truncate_to_three)
    ours, hf = load_tokenizer(model_dir), _hf(model_dir)
    assert len(ours) == len(hf) == 49154
    text = "a<|newtok|>b plainword and a long sentence , that is not truncated ."
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"] and len(ids) > 3 and 49152 in ids and 49153 in ids
    for skip in (True, False):
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_a_broken_tokenizer_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelFormatError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match=re.escape(str(tmp_path))):
        load_tokenizer(tmp_path)


def test_serving_a_model_does_not_import_transformers(
    tmp_path: Path, tiny_llama_dir: Path, embedded_model_dir: Path
) -> None:
    """The start-up cost this module exists to remove: an offline engine on a model directory
    tokenizes, renders a chat and generates without transformers in the process."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    shutil.copy(embedded_model_dir / "chat_template.jinja", model_dir)
    script = f"""
import sys
from rankcast import LLM, SamplingParams
llm = LLM(model={str(model_dir)!r}, dtype="float32", kv_cache_space_gib=0.1)
try:
    out = llm.chat([[{{"role": "user", "content": "hi"}}]], SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2, out
finally:
    llm.shutdown()
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
