"""The Rust frontend's tokenizer (`rust/text`) against the Python one, on the embedded model's
`tokenizer.json`: identical ids on the benchmark prompts (raw and chat-templated, special tokens
included) and on a corpus of unicode, emoji, whitespace runs and digits; identical decodes; and
an incremental decode whose pieces join to the full decode without splitting a character."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rankcast.tokenizer import load_tokenizer
from tests.rust_build import binary

ROOT = Path(__file__).resolve().parent.parent

CORPUS = [
    "",
    "Hello, world!",
    "I'll say it's done; you've we'd they're I'm",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\n  \t \n",
    "    four spaces then text",
    "\n",
    "digits 1234567890 3.14159 -42 1e10 0x1F 2026-11-30",
    "99999999999999999999999999",
    "emoji 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "中文\uff0c日本語のテキスト、한국어 텍스트",
    "العربية مع أرقام ١٢٣",
    "Ünïcödé çømbîñîng: e\u0301 a\u0308 n\u0303",
    "math ∑∫√∞ ≠ ≤ ≥ arrows → ← ↔",
    "code: def f(x):\n    return x**2  # comment\n",
    '{"json": [1, 2.5, null, true], "s": "q\\"uote"}',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>text<|endoftext|>",
    "<|im_start|",
    "control \x00\x01\x1f\x7f chars",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "a" * 300,
    "ab " * 100,
    "!!!???...,,,;;;",
]


def _python_tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


def _run(model_dir: Path, items: list[Any], tmp_path: Path) -> list[dict[str, Any]]:
    """The Rust side on `items` (texts to encode, or lists of ids to decode)."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(items))
    result = subprocess.run(
        [binary("tokenize"), model_dir / "tokenizer.json", corpus],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out: list[dict[str, Any]] = json.loads(result.stdout)
    return out


@pytest.fixture(scope="module")
def texts(embedded_model_dir: Path) -> list[str]:
    prompts = json.loads((ROOT / "bench" / "prompts.json").read_text())["prompts"]
    tokenizer = _python_tokenizer(embedded_model_dir)
    templated = [
        tokenizer.render_chat([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in prompts[:8]
    ]
    return [*CORPUS, *prompts, *templated]


def test_ids_and_decodes_equal_the_python_tokenizers(
    embedded_model_dir: Path, texts: list[str], tmp_path: Path
) -> None:
    tokenizer = _python_tokenizer(embedded_model_dir)
    results = _run(embedded_model_dir, texts, tmp_path)
    assert len(results) == len(texts)
    for text, got in zip(texts, results, strict=True):
        want = list(tokenizer.encode(text, add_special_tokens=False))
        assert got["ids"] == want, repr(text[:60])
        assert got["decoded"] == tokenizer.decode(want, skip_special_tokens=False), repr(text[:60])
        assert got["decoded"] == text, "byte-level BPE decodes back to the text"


def test_incremental_pieces_join_to_the_decode_and_never_split_a_character(
    embedded_model_dir: Path, texts: list[str], tmp_path: Path
) -> None:
    for text, got in zip(texts, _run(embedded_model_dir, texts, tmp_path), strict=True):
        assert "".join(got["pieces"]) == got["decoded"], repr(text[:60])
        if "\ufffd" not in text:
            assert not any("\ufffd" in piece for piece in got["pieces"]), repr(text[:60])


def test_arbitrary_ids_decode_as_python_decodes_them(
    embedded_model_dir: Path, tmp_path: Path
) -> None:
    """Token sequences a model may emit that are not valid UTF-8 at every step (byte tokens of
    half characters, say): the Rust decode equals the Python decode, replacement characters
    included, and the incremental pieces still join to it."""
    tokenizer = _python_tokenizer(embedded_model_dir)
    rng = random.Random(1234)
    byte_tokens = [i for i in range(17, 300)]  # single bytes, many of them half characters
    sequences = [
        [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(17, len(tokenizer))
            for _ in range(40)
        ]
        for _ in range(30)
    ]
    results = _run(embedded_model_dir, sequences, tmp_path)
    replaced = 0
    for ids, got in zip(sequences, results, strict=True):
        want = tokenizer.decode(ids, skip_special_tokens=False)
        assert got["decoded"] == want
        assert "".join(got["pieces"]) == want
        replaced += "\ufffd" in want
    assert replaced > 0, "the sequences should include invalid UTF-8"
