"""One chat turn asked through each API rankcast serves: `/v1/chat/completions`, `/v1/responses`
and `/v1/messages` (bench/serve.py --apis).

The three are one chat turn inside the server (rankcast/api_server/chat_turn.py), so the same
conversation must give the same greedy text and cost the same; what differs is the request's
shape and the stream's event shapes, which this module writes and reads. Greedy, each request
ends where the model stops (the newer APIs have no `ignore_eos`), so the figures are compared
between APIs, not with bench/serve.py's main table.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from bench.sse_client import SSEClient

APIS = ("chat", "responses", "messages")
_decode = msgspec.json.Decoder().decode


def request(api: str, prompt: str, tokens: int) -> tuple[str, dict[str, Any]]:
    """The route and streaming body of one greedy turn."""
    if api == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if api == "responses":
        return "/v1/responses", {
            "input": prompt,
            "max_output_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "store": False,
        }
    if api == "messages":
        return "/v1/messages", {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
        }
    raise ValueError(f"unknown API {api!r}")


def read(api: str, data: dict[str, Any]) -> tuple[str, int | None]:
    """The text one event adds, and the output tokens when the event reports them."""
    if api == "chat":
        if data.get("usage"):
            return "", data["usage"]["completion_tokens"]
        choices = data.get("choices") or [{}]
        return choices[0].get("delta", {}).get("content") or "", None
    kind = data.get("type")
    if api == "responses":
        if kind == "response.output_text.delta":
            return data["delta"], None
        if kind in ("response.completed", "response.incomplete"):
            return "", data["response"]["usage"]["output_tokens"]
        return "", None
    if kind == "content_block_delta" and data["delta"].get("type") == "text_delta":
        return data["delta"]["text"], None
    if kind == "message_delta":
        return "", data["usage"]["output_tokens"]
    return "", None


async def one_turn(http: SSEClient, api: str, prompt: str, tokens: int) -> dict[str, Any]:
    path, body = request(api, prompt, tokens)
    start = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    produced = 0

    def on_event(event: bytes, now: float) -> None:
        nonlocal produced
        line = next((ln for ln in event.split(b"\n") if ln.startswith(b"data: ")), None)
        if line is None or line == b"data: [DONE]":
            return
        piece, count = read(api, _decode(line[6:]))
        if piece:
            stamps.append(now)
            text.append(piece)
        if count is not None:
            produced = count

    await http.stream(path, body, on_event)
    return {"text": "".join(text), "tokens": produced, "start": start, "stamps": stamps}


async def run_api(url: str, api: str, prompts: list[str], tokens: int, concurrency: int) -> dict:
    """Every prompt once through `api`, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with SSEClient(url, concurrency + 4) as http:

        async def guarded(prompt: str) -> dict[str, Any]:
            async with gate:
                return await one_turn(http, api, prompt, tokens)

        start = time.perf_counter()
        turns = await asyncio.gather(*(guarded(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ttfts = sorted(t["stamps"][0] - t["start"] for t in turns if t["stamps"])
    return {
        "api": api,
        "concurrency": concurrency,
        "output_tokens": sum(t["tokens"] for t in turns),
        "tokens_per_s": sum(t["tokens"] for t in turns) / elapsed,
        "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1000 if ttfts else float("nan"),
        "texts": [t["text"] for t in turns],
    }


def compare(url: str, prompts: list[str], tokens: int, levels: list[int], runs: int) -> dict:
    """Each API at each level, `runs` times interleaved (chat, responses, messages, chat, ...)
    so the machine's drift falls on all three alike; the median run per API and level, and
    whether every API gave chat's texts."""
    asyncio.run(run_api(url, "chat", prompts[:2], tokens, 2))  # warm-up
    rows = []
    for n in levels:
        tries: dict[str, list[dict]] = {api: [] for api in APIS}
        for _ in range(runs):
            for api in APIS:
                tries[api].append(asyncio.run(run_api(url, api, prompts, tokens, n)))
        for api in APIS:
            ranked = sorted(tries[api], key=lambda r: r["tokens_per_s"])
            row = dict(ranked[len(ranked) // 2])
            row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in ranked]
            rows.append(row)
    chat_texts = {r["concurrency"]: r["texts"] for r in rows if r["api"] == "chat"}
    for row in rows:
        reference = chat_texts[row["concurrency"]]
        row["differing_texts"] = sum(
            a != b for a, b in zip(row.pop("texts"), reference, strict=True)
        )
    return {"levels": rows}


def print_comparison(result: dict) -> None:
    print("\nThe same chat turn through each API (greedy, to the model's own stop)")
    print(f"{'API':<12}{'N':>4}{'tok/s':>9}{'vs chat':>9}{'TTFT p50':>10}{'texts differing':>17}")
    chat = {r["concurrency"]: r["tokens_per_s"] for r in result["levels"] if r["api"] == "chat"}
    for row in result["levels"]:
        ratio = row["tokens_per_s"] / chat[row["concurrency"]]
        print(
            f"{row['api']:<12}{row['concurrency']:>4}{row['tokens_per_s']:>9.1f}{ratio:>8.2f}x"
            f"{row['ttft_p50_ms']:>10.0f}{row['differing_texts']:>17}"
        )
