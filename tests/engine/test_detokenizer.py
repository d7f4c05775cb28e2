"""Incremental detokenization: never half a character, stop strings held back while streaming."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankcast.engine_client.detokenizer import IncrementalDetokenizer
from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path):
    return load_tokenizer(embedded_model_dir)


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = "Crème brûlée 😀 costs 5€ — 世界你好 🇫🇷!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE splits the emoji and CJK characters over several tokens.
    assert len(ids) > len(text.split())
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    pieces = []
    for token in ids:
        detok.update([token])
        delta = detok.take_delta(finished=False)
        assert "\ufffd" not in delta
        pieces.append(delta)
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces), "some tokens carry only part of a character"


def test_stop_string_spanning_tokens_is_held_back_then_cut(tokenizer) -> None:
    text = "alpha beta STOPHERE gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOPHERE"]))
    streamed = ""
    matched = None
    for token in ids:
        matched = detok.update([token])
        streamed += detok.take_delta(finished=matched is not None)
        assert "STOP" not in streamed, "a prefix of the stop string must not be streamed"
        if matched:
            break
    assert matched == "STOPHERE"
    assert streamed == "alpha beta "


def test_first_token_keeps_its_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    answer = tokenizer.encode(" Paris", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(answer)
    assert detok.take_delta(finished=True) == " Paris"
