"""The Responses and Messages renderers and the response store on their own: what reasoning,
text and tool calls become in each API's output and event stream (the servers' tests cover the
model's real output; here the output is given, so every kind of piece is covered), and the
store's bounds."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rankcast.api_server import response_store
from rankcast.api_server.anthropic_messages import _message_events
from rankcast.api_server.chat_turn import CallPiece, ChatTurn, TextPiece, TurnReader
from rankcast.api_server.openai_responses import (
    ResponseRun,
    ResponsesRequest,
    _response_events,
    chat_body,
)
from rankcast.api_server.output_parsers import HermesToolParser, OutputParser, ThinkParser
from rankcast.api_server.response_store import ResponseStore, StoredResponse
from rankcast.outputs import CompletionOutput, RequestOutput

# The model's output, as the engine would stream it, a few characters at a time.
OUTPUT = (
    '<think>It is Paris.</think>Let me check.<tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}</tool_call>'
)


def _outputs(text: str, step: int = 7) -> list[RequestOutput]:
    outputs = []
    for start in range(0, len(text), step):
        delta = text[start : start + step]
        done = start + step >= len(text)
        tokens = list(range(start // step + 1))
        completion = CompletionOutput(
            0, text[: start + step], tokens, "stop" if done else None, delta_text=delta
        )
        outputs.append(RequestOutput("r", None, [1, 2, 3], [completion], done))
    return outputs


def _turn(request_id: str) -> ChatTurn:
    async def stream() -> AsyncIterator[RequestOutput]:
        for output in _outputs(OUTPUT):
            yield output

    parser = OutputParser(ThinkParser(opened=False, call_ends=True), HermesToolParser())
    return ChatTurn(request_id, "m", [1, 2, 3], stream(), 0, None, parser)


async def _collect(events: AsyncIterator[bytes]) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    async for chunk in events:
        for event in chunk.decode().split("\n\n"):
            if event:
                kind, data = event.split("\n")
                parsed.append(
                    (kind.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
                )
    return parsed


def test_pieces_are_the_same_streamed_or_whole() -> None:
    reader = TurnReader(_turn("x"))
    streamed = [piece for output in _outputs(OUTPUT) for piece in reader.feed(output)]
    whole = TurnReader(_turn("y")).whole(_outputs(OUTPUT)[-1].outputs[0])

    def merged(pieces: list[Any]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for p in pieces:
            key = p.kind if isinstance(p, TextPiece) else "call"
            text = p.text if isinstance(p, TextPiece) else f"{p.name}:{p.arguments}"
            if out and out[-1][0] == key and key != "call":
                out[-1] = (key, out[-1][1] + text)
            else:
                out.append((key, text))
        return out

    expected = [
        ("reasoning", "It is Paris."),
        ("content", "Let me check."),
        ("call", 'get_weather:{"city": "Paris"}'),
    ]
    assert merged(streamed) == merged(whole) == expected
    assert all(isinstance(p, CallPiece) for p in whole[2:])


def test_a_response_stream_opens_and_closes_each_item_in_order(tmp_path: Path) -> None:
    body = ResponsesRequest(input="weather?", tools=[{"type": "function", "name": "get_weather"}])
    store = ResponseStore(str(tmp_path))
    run = ResponseRun(body, _turn("resp_" + "a" * 32), chat_body(body, []), store)
    events = asyncio.run(_collect(_response_events(run)))
    kinds = [kind for kind, _ in events]
    assert [data["type"] for _, data in events] == kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "It is Paris."}]
    assert final["output"][1]["content"][0]["text"] == "Let me check."
    assert json.loads(final["output"][2]["arguments"]) == {"city": "Paris"}
    indexes = [data["output_index"] for kind, data in events if kind == "response.output_item.done"]
    assert indexes == [0, 1, 2]
    # Stored with the conversation a continuation starts from: the call, not the reasoning.
    stored = store.get(final["id"])
    assert stored is not None and stored.response == final
    assert stored.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert stored.messages[-1]["content"] == "Let me check."


def test_a_message_stream_has_one_block_per_kind() -> None:
    events = asyncio.run(_collect(_message_events(_turn("msg_1"))))
    blocks = [
        (data["index"], data["content_block"]["type"])
        for kind, data in events
        if kind == "content_block_start"
    ]
    assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    stops = [data["index"] for kind, data in events if kind == "content_block_stop"]
    assert stops == [0, 1, 2]
    deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "It is Paris."
    assert "".join(d.get("text", "") for d in deltas) == "Let me check."
    partial = "".join(d.get("partial_json", "") for d in deltas)
    assert json.loads(partial) == {"city": "Paris"}
    kind, last = events[-2]
    assert kind == "message_delta" and last["delta"]["stop_reason"] == "tool_use"
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"


def _age(directory: Path) -> None:
    """Give the files distinct, increasing ages in name order (a coarse clock could tie)."""
    for i, path in enumerate(sorted(directory.glob("*.json"))):
        os.utime(path, ns=(i * 10**9, i * 10**9))


def test_the_store_keeps_the_newest_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(response_store, "MAX_RESPONSES", 3)
    store = ResponseStore(str(tmp_path))
    ids = [f"resp_{i:032x}" for i in range(5)]
    for response_id in ids:
        store.put(response_id, StoredResponse({"id": response_id}, []))
        _age(tmp_path)
    assert [store.get(i) is not None for i in ids] == [False, False, True, True, True]
    # Another server's store over the same directory reads the same responses.
    other = ResponseStore(str(tmp_path))
    assert other.get(ids[4]) == StoredResponse({"id": ids[4]}, [])
    assert other.delete(ids[4]) and store.get(ids[4]) is None and not store.delete(ids[4])

    monkeypatch.setattr(response_store, "MAX_BYTES", 300)
    big = StoredResponse({"text": "x" * 200}, [])
    store.put(ids[0], big)
    _age(tmp_path)
    store.put(ids[1], big)
    assert store.get(ids[1]) == big and store.get(ids[0]) is None
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json")) <= 300
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_store_takes_only_its_own_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret.json").write_text('{"response": {}, "messages": []}')
    store = ResponseStore(str(tmp_path / "responses"))
    for bad in ("../secret", "resp_../../secret", "resp_" + "g" * 32, ""):
        assert store.get(bad) is None and not store.delete(bad)
    monkeypatch.delenv(response_store.RESPONSE_STORE_ENV, raising=False)
    memory = ResponseStore()
    assert memory.directory is None
    memory.put("resp_" + "0" * 32, StoredResponse({}, []))
    assert memory.get("resp_" + "0" * 32) == StoredResponse({}, [])
