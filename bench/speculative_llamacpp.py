"""llama.cpp's `llama-server --spec-type` in bench/speculative.py's cells: the conversations,
clients and clocks rankcast's methods get, so the two engines' speculation meet in one run.

Each configuration (speculation off, or one `--spec-type` that needs no draft model, with
llama.cpp's own defaults for it) runs on a fresh `llama-server`, so neither its prompt cache nor
an ngram-cache's memory carries anything from another configuration. The server runs the anchor's
BF16 file: the embedded SmolLM2-135M-Instruct's weights in bfloat16, the dtype rankcast serves
them in. It gets one slot per client, each slot room for the longest prompt and answer, every
core (`-t`), and `--metrics` for its speculation counters (verifications, drafted and accepted
tokens: the three counts rankcast's scheduler keeps, under the same names).

Requests go to `/v1/chat/completions`, which renders the GGUF's chat template; every request's
`usage.prompt_tokens` is compared with rankcast's prompt for the same conversation, and the first
conversation's tokens one by one (`/apply-template`, then `/tokenize`). Greedy: temperature 0,
which llama.cpp's sampler turns into an argmax. The same `max_tokens`, EOS honoured, streamed
with usage, so an answer's tokens are `usage.completion_tokens` and its arrivals those of the
chunks that carry text (llama-server streams a chunk per token, an accepted draft's tokens
together). The prompt cache stays on, as rankcast's prefix cache does; llama.cpp says that can
change a greedy answer (a prompt's cached KV was computed in a batch of another size), so its
speculation's exactness is judged against its own runs without speculation, every run of them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from bench import llamacpp
from bench.sse_client import SSEClient
from bench.workload import Chat
from tests.entrypoints.server_process import free_port

WEIGHT_TYPE = "BF16"
LOG = Path(tempfile.gettempdir()) / "rankcast-speculative-llama-server.log"
OFF = "llama off"

_decode = msgspec.json.Decoder().decode


def draft_free_types() -> tuple[str, ...]:
    """The `--spec-type` values of the installed llama-server that need no draft model (every
    one but `none` and the `draft-*` ones)."""
    return tuple(t for t in llamacpp.spec_types() if t != "none" and not t.startswith("draft-"))


def missing_message() -> str | None:
    """Why llama-server cannot run here, or None."""
    problem = llamacpp.missing_message("llama-server")
    if problem is None and WEIGHT_TYPE not in llamacpp.models():
        problem = f"no smol-{WEIGHT_TYPE}.gguf in {llamacpp.llamacpp_dir() / 'models'}"
    return problem


def server_info() -> dict[str, Any]:
    """What the output records of the llama-server it runs (call where missing_message() is
    None)."""
    server = llamacpp.binary("llama-server")
    assert server is not None
    done = subprocess.run(
        [str(server), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    lines = (done.stdout + done.stderr).splitlines()
    version = next((line.removeprefix("version: ") for line in lines if "version" in line), "")
    request = {key: value for key, value in _body([], 0).items() if key != "messages"}
    del request["max_tokens"]
    return {
        "binary": str(server),
        "version": version or "version unknown",
        "model": str(llamacpp.models()[WEIGHT_TYPE]),
        "weight_type": WEIGHT_TYPE,
        "threads": llamacpp.threads(),
        "prompt_cache": True,
        "request": request,
    }


def method_name(spec_type: str | None) -> str:
    return OFF if spec_type is None else f"llama {spec_type}"


def _slot_tokens(longest_prompt: int, tokens: int) -> int:
    """A slot's context: the longest prompt, its answer and a margin, in 256-token steps."""
    return -(-(longest_prompt + tokens + 64) // 256) * 256


def _body(chat: Chat, tokens: int) -> dict[str, Any]:
    return {
        "messages": chat,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _answer(http: SSEClient, chat: Chat, tokens: int) -> dict[str, Any]:
    """One streamed chat: when it was sent, when each chunk with text arrived, the text, and
    the usage and finish reason the server reported."""
    answer: dict[str, Any] = {"arrivals": [], "pieces": [], "usage": None, "finish": None}

    def on_event(event: bytes, now: float) -> None:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        chunk = _decode(event[6:])
        if chunk.get("usage"):
            answer["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or ():
            answer["finish"] = choice.get("finish_reason") or answer["finish"]
            content = choice.get("delta", {}).get("content")
            if content:
                answer["arrivals"].append(now)
                answer["pieces"].append(content)

    answer["sent"] = time.perf_counter()
    await http.stream("/v1/chat/completions", _body(chat, tokens), on_event)
    if answer["usage"] is None:
        raise RuntimeError("llama-server sent no usage with its answer")
    return answer


async def _closed_loop(
    url: str, chats: list[Chat], tokens: int, clients: int
) -> tuple[list[dict[str, Any]], float]:
    """`clients` closed-loop clients over `chats` (each sends the next conversation not yet
    sent as soon as its answer is done): every answer, and the seconds from the first send to
    the last answer."""
    answers: list[dict[str, Any]] = [{} for _ in chats]
    waiting = iter(range(len(chats)))
    async with SSEClient(url, clients + 2) as http:

        async def client() -> None:
            for index in waiting:  # shared: each client takes the next conversation
                answers[index] = await _answer(http, chats[index], tokens)

        begin = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(clients, len(chats)))))
        seconds = time.perf_counter() - begin
    return answers, seconds


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _prompt_ids(url: str, chat: Chat) -> list[int]:
    """The tokens llama-server's chat endpoint gives `chat`: its template, then its tokenizer
    (special tokens parsed, as the endpoint does; a BOS the GGUF wants would show as a
    difference in the usage counts)."""
    prompt = _post(f"{url}/apply-template", {"messages": chat})["prompt"]
    body = {"content": prompt, "add_special": False, "parse_special": True}
    tokens: list[int] = _post(f"{url}/tokenize", body)["tokens"]
    return tokens


def _spec_counters(url: str) -> dict[str, Any]:
    """The speculation counters of llama-server's /metrics (its totals since start)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    names = {
        "llamacpp:spec_decode_num_drafts_total": "drafts",
        "llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
        "llamacpp:spec_decode_num_accepted_tokens_total": "accepted_tokens",
    }
    counters: dict[str, Any] = {key: 0 for key in names.values()}
    per_position: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name in names:
            counters[names[name]] = int(float(value))
        elif name.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{"):
            position = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_position[position] = int(float(value))
    counters["accepted_per_position"] = [per_position[p] for p in sorted(per_position)]
    return counters


def _spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The timed run's counters (the warm-up's subtracted), with rankcast's derived figures;
    the per-position counts stop at the last position that accepted anything."""
    spec = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted_tokens")}
    earlier = before["accepted_per_position"]
    positions = [
        count - (earlier[p] if p < len(earlier) else 0)
        for p, count in enumerate(after["accepted_per_position"])
    ]
    while positions and positions[-1] == 0:
        positions.pop()
    spec["accepted_per_position"] = positions
    spec["acceptance_length"] = (
        1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else None
    )
    spec["draft_acceptance_rate"] = (
        spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None
    )
    return spec


def run_config(
    spec_type: str | None,
    chats: list[Chat],
    concurrency: int,
    tokens: int,
    warm_up: tuple[list[Chat], int],
    prompts: list[list[int]],
) -> dict[str, Any]:
    """One fresh llama-server with `spec_type` (None: speculation off): the warm-up's chats all
    at once, then `chats` from `concurrency` closed-loop clients, timed; then its prompts are
    checked against `prompts` (rankcast's token ids for `chats`). A row shaped as
    bench/speculative.py's rankcast rows (per-request TPOT and TTFT, which it summarises),
    with texts but no token ids."""
    started = time.perf_counter()
    warm_chats, warm_tokens = warm_up
    slot = _slot_tokens(max(map(len, prompts)), max(tokens, warm_tokens))
    parallel = max(1, concurrency)
    extra = ["--metrics"] + ([] if spec_type is None else ["--spec-type", spec_type])
    with llamacpp.LlamaServer(
        WEIGHT_TYPE, free_port(), parallel=parallel, context=slot * parallel, log=LOG, extra=extra
    ) as server:
        ready = server.wait_ready()
        asyncio.run(_closed_loop(server.url, warm_chats, warm_tokens, len(warm_chats)))
        before = _spec_counters(server.url)
        answers, seconds = asyncio.run(_closed_loop(server.url, chats, tokens, concurrency))
        after = _spec_counters(server.url)
        first_ids = _prompt_ids(server.url, chats[0])
    counts = [answer["usage"]["completion_tokens"] for answer in answers]
    prompt_counts = [answer["usage"]["prompt_tokens"] for answer in answers]
    tpot = [
        (answer["arrivals"][-1] - answer["arrivals"][0]) / (count - 1)
        for answer, count in zip(answers, counts, strict=True)
        if count > 1 and answer["arrivals"]
    ]
    ttft = [answer["arrivals"][0] - answer["sent"] for answer in answers if answer["arrivals"]]
    row: dict[str, Any] = {
        "method": method_name(spec_type),
        "engine": "llama-server",
        "spec_type": spec_type,
        "server_flags": server.command[1:],
        "start_seconds": ready,
        "requests": len(answers),
        "output_tokens": sum(counts),
        "seconds": seconds,
        "tokens_per_s": sum(counts) / seconds,
        "tpot_ms": [s * 1000 for s in tpot],
        "ttft_ms": [s * 1000 for s in ttft],
        "request_tokens": counts,
        "finish_reasons": [answer["finish"] for answer in answers],
        "texts": ["".join(answer["pieces"]) for answer in answers],
        "prompt_tokens": prompt_counts,
        "prompt_tokens_differing": sum(
            ours != len(theirs) for ours, theirs in zip(prompt_counts, prompts, strict=True)
        ),
        "first_prompt_tokens_equal": first_ids == prompts[0],
        "engine_seconds": time.perf_counter() - started,
    }
    if spec_type is not None:
        row["spec_decode"] = _spec_delta(before, after)
    return row


def log_tail(lines: int = 15) -> str:
    """The end of the last server's log, for an error message."""
    try:
        return "\n".join(LOG.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
