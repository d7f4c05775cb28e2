"""`rankcast serve --rust-api-server-count`: Rust API servers in the fleet beside the Python
ones, behind the same port, answering with the same text, and restarted by the launcher when
they die, like the Python ones."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rankcast.api_server.openapi_document import RUST_UNSERVED, rendered
from tests.entrypoints.notification_clients import families, scrape_each
from tests.entrypoints.server_process import ServerProcess, free_port, tiny_model_args
from tests.entrypoints.test_server_chat_parsers import PARSER_FLAGS
from tests.frontend_rust.rust_fleet import frontend_env, kill_and_wait_for_restart
from tests.lora.conftest import make_adapter
from tests.reliability.fleet import StreamedCompletion, assert_cut_by_the_shutdown

MODEL = "SmolLM2-135M-Instruct"
DASHBOARD = Path(__file__).resolve().parents[2] / "rankcast" / "api_server" / "dashboard"


BODY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _by_server(url: str, rounds: int, until: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """Texts of the same greedy completion, by the API server (header) that answered: `rounds`
    requests, then more until every server in `until` has answered one (the kernel spreads
    fresh connections over the servers by a hash, so a given count may miss one)."""
    seen: dict[str, list[str]] = {}
    deadline = time.monotonic() + 60
    sent = 0
    while sent < rounds or not until <= seen.keys():
        assert time.monotonic() < deadline, f"{sorted(until)} not all answered: {sorted(seen)}"
        # A fresh connection each time, so the kernel spreads them over the servers.
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert response.status_code == 200, response.text
        server = response.headers["x-rankcast-api-server"]
        seen.setdefault(server, []).append(response.json()["choices"][0]["text"])
        sent += 1
    return seen


def _streamed_by_server(url: str) -> tuple[dict[str, str], int]:
    """BODY streamed, its deltas joined, by the API server that answered (fresh connections
    until both kinds have answered once; a delta may carry several tokens), and how many
    requests that took."""
    seen: dict[str, str] = {}
    sent = 0
    deadline = time.monotonic() + 60
    while set(seen) != {"0", "1"}:
        assert time.monotonic() < deadline, f"streamed only by {sorted(seen)}"
        text = ""
        sent += 1
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=60
        ) as reply:
            assert reply.status_code == 200
            server = reply.headers["x-rankcast-api-server"]
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        if server not in seen:
            seen[server] = text
    return seen, sent


def _dashboard_by_server(url: str, path: str) -> dict[str, bytes]:
    """`path` as each of the three servers serves it (fresh connections until each answered)."""
    seen: dict[str, bytes] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 3:
        assert time.monotonic() < deadline, f"{path} answered only by servers {sorted(seen)}"
        response = httpx.get(f"{url}{path}", timeout=10)
        assert response.status_code == 200, (path, response.text)
        seen[response.headers["x-rankcast-api-server"]] = response.content
    return seen


def test_python_and_rust_servers_share_the_port_and_the_answers(tiny_llama_dir: Path) -> None:
    server = ServerProcess(
        *tiny_model_args(tiny_llama_dir),
        api_server_count=2,
        rust_api_server_count=1,
        env=frontend_env(),
    )
    with server.running():
        seen = _by_server(server.url, 24, until=frozenset({"0", "1", "2"}))
        assert set(seen) == {"0", "1", "2"}, f"not every server answered: {seen}"
        texts = set().union(*seen.values())
        assert len(texts) == 1, f"the servers disagree: {seen}"
        # The dashboard: the same bytes from every server, the package's own files.
        for path, name in (
            ("/dashboard", "index.html"),
            ("/dashboard/dashboard.js", "dashboard.js"),
            ("/dashboard/dashboard.css", "dashboard.css"),
        ):
            want = (DASHBOARD / name).read_bytes()
            for index, body in _dashboard_by_server(server.url, path).items():
                assert body == want, f"server {index} serves another {path}"
        for index, body in _dashboard_by_server(server.url, "/health").items():
            engines = json.loads(body)["engines"]
            assert engines == [{"engine": 0, "up": True, "incarnation": 0}], (index, engines)

        kill_and_wait_for_restart(server)
        deadline = time.monotonic() + 60
        while True:  # until the new one answers too
            assert time.monotonic() < deadline, "the restarted Rust API server never answered"
            try:
                if "2" in _by_server(server.url, 6):
                    break
            except (AssertionError, httpx.HTTPError):
                pass
            time.sleep(0.2)
        assert set().union(*_by_server(server.url, 12).values()) == texts


def _generation_tokens(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def test_rust_servers_alone_are_a_fleet(tiny_llama_dir: Path) -> None:
    """`--api-server-count 0 --rust-api-server-count 2`: the Rust servers serve the port by
    themselves (the lightest fleet per streamed token): both answer, with the same text,
    streamed to [DONE] as well, and both report the fleet's summed tokens."""
    server = ServerProcess(
        *tiny_model_args(tiny_llama_dir),
        api_server_count=0,
        rust_api_server_count=2,
        env=frontend_env(),
    )
    with server.running():
        seen = _by_server(server.url, 16, until=frozenset({"0", "1"}))
        assert set(seen) == {"0", "1"}, f"not every server answered: {seen}"
        texts = set().union(*seen.values())
        assert len(texts) == 1, f"the servers disagree: {seen}"
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert {streamed} == texts
        expected = 17 * BODY["max_tokens"]
        deadline = time.monotonic() + 30
        while True:
            totals = {k: _generation_tokens(t) for k, t in scrape_each(server.url, 2).items()}
            if set(totals.values()) == {expected}:
                break
            assert time.monotonic() < deadline, f"fleet tokens {totals}, expected {expected}"
            time.sleep(0.2)


def test_a_stop_drains_the_rust_server_like_the_python_ones() -> None:
    """SIGTERM to the launcher: the Rust server refuses new work with 503 + Retry-After at once,
    and a stream that outlives --shutdown-timeout ends with finish reason "abort", the error
    naming the timeout, and [DONE]; the launcher exits 0 with nothing left."""
    server = ServerProcess(
        "--max-model-len", "1024", "--shutdown-timeout", "2",
        api_server_count=1, rust_api_server_count=1, env=frontend_env(),
    )  # fmt: skip
    try:
        server.wait_healthy()
        stream = None
        deadline = time.monotonic() + 60
        while stream is None or stream.server != "1":
            assert time.monotonic() < deadline, "no stream landed on the Rust server"
            if stream is not None:
                stream.cancel()  # it landed on the Python server: not left to take the CPU
            stream = StreamedCompletion(server.url, model=MODEL, max_tokens=900)
            assert stream.first.wait(60), "the stream should be running before the stop"
        server.proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 3
        while refused is None and time.monotonic() < deadline:
            try:
                response = httpx.get(f"{server.url}/health", timeout=10)
            except httpx.TransportError:
                # The Python server, with nothing in flight, closes its listener at once;
                # a connection the kernel had queued on that listener is reset.
                continue
            if response.status_code == 503 and response.headers["x-rankcast-api-server"] == "1":
                refused = response
        assert refused is not None, "the Rust server did not refuse new work"
        assert refused.headers["retry-after"]
        assert "shutting down" in refused.json()["error"]["message"]
        stream.thread.join(30)
        assert not stream.thread.is_alive(), "the cut stream must end, not hang"
        assert server.proc.wait(30) == 0
    finally:
        assert server.stop() == []
    assert_cut_by_the_shutdown(stream)


def test_the_rust_server_reports_the_engine_series_as_the_python_ones(
    tiny_llama_dir: Path,
) -> None:
    """Every family the Rust server exposes (the engine-derived ones: load, cache
    configuration, notification totals and drops, weight loads; and the ones each server counts
    itself, summed over the fleet) is line for line the Python server's, at rest after
    traffic that both served. The engine's KV cache is 8-bit: both name it the same way. It
    speculates (suffix decoding: the same completion again drafts from the last one's output),
    and both show vLLM's speculative-decoding counters alike."""
    server = ServerProcess(
        *tiny_model_args(
            tiny_llama_dir,
            "--kv-cache-dtype",
            "int8",
            "--speculative-config",
            '{"method": "suffix", "num_speculative_tokens": 4}',
        ),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )
    with server.running():
        served = _by_server(server.url, 12, until=frozenset({"0", "1"}))
        requests = sum(len(texts) for texts in served.values())
        # The first answer was decoded a token a step, later ones from drafts of it: one text.
        (text,) = {t for texts in served.values() for t in texts}
        streamed, sent = _streamed_by_server(server.url)
        assert streamed == {"0": text, "1": text}, streamed
        requests += sent
        deadline = time.monotonic() + 30
        while True:
            bodies = scrape_each(server.url, 2)
            python, rust = families(bodies["0"]), families(bodies["1"])
            differing = [name for name in rust if rust[name] != python.get(name)]
            if not differing:
                break
            assert time.monotonic() < deadline, "\n".join(
                f"{name}:\n  python {python.get(name)}\n  rust   {rust[name]}" for name in differing
            )
            time.sleep(0.2)
    assert len(rust) >= 15, sorted(rust)
    # What each server counts itself is summed over both: the Rust server's requests too.
    assert set(served) == {"0", "1"}, served
    (success,) = [line for line in rust["vllm:request_success_total"] if line[0] != "#"]
    assert 'finished_reason="length"' in success and success.endswith(f" {requests}.0"), success
    ttft = [line for line in rust["vllm:time_to_first_token_seconds"] if "_count{" in line]
    assert len(ttft) == 1 and ttft[0].endswith(f" {requests}.0"), ttft
    weights = rust["rankcast:worker_weights_load_seconds"]
    assert any(line.startswith("rankcast:worker_weights_load_seconds{") for line in weights)
    assert 'rankcast:engine_up{engine="0"} 1.0' in rust["rankcast:engine_up"]
    (config,) = [line for line in rust["vllm:cache_config_info"] if line[0] != "#"]
    assert 'block_size="16",cache_dtype="int8",engine="0"' in config, config
    (accepted,) = [
        line for line in rust["vllm:spec_decode_num_accepted_tokens_total"] if line[0] != "#"
    ]
    assert float(accepted.rsplit(" ", 1)[1]) > 0, accepted
    per_position = [
        line
        for line in rust["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
        if line[0] != "#"
    ]
    assert 'position="0"' in per_position[0], per_position


def test_the_rust_server_serves_adapters_by_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An adapter registered at start is a model of its own on every server: the same model
    cards, the same text under its name, and an unknown name a 404 naming it."""
    adapter = tmp_path / "sql"
    make_adapter(tiny_llama_dir, adapter, rank=4, alpha=8)
    server = ServerProcess(
        *tiny_model_args(
            tiny_llama_dir,
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}",
        ),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )  # fmt: skip
    with server.running():
        cards: dict[str, list[dict[str, object]]] = {}
        deadline = time.monotonic() + 30
        while set(cards) != {"0", "1"}:
            assert time.monotonic() < deadline, f"only {sorted(cards)} answered"
            response = httpx.get(f"{server.url}/v1/models", timeout=10)
            data = response.json()["data"]
            cards[response.headers["x-rankcast-api-server"]] = [
                {k: v for k, v in card.items() if k != "created"} for card in data
            ]
        assert cards["1"] == cards["0"]
        assert [card["id"] for card in cards["1"]][1:] == ["sql"]
        body = {**BODY, "model": "sql"}
        texts: dict[str, set[str]] = {}
        for _ in range(24):
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "sql"
            server_index = response.headers["x-rankcast-api-server"]
            texts.setdefault(server_index, set()).add(response.json()["choices"][0]["text"])
        assert set(texts) == {"0", "1"} and len(set().union(*texts.values())) == 1, texts
        base = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60).json()
        assert texts["1"] != {base["choices"][0]["text"]}, "the adapter must change the text"
        missing = {}
        for _ in range(24):
            response = httpx.post(
                f"{server.url}/v1/completions", json={**BODY, "model": "nope"}, timeout=60
            )
            missing[response.headers["x-rankcast-api-server"]] = response
        for response in missing.values():
            assert response.status_code == 404
            assert response.json()["error"]["message"] == "The model `nope` does not exist."
        assert set(missing) == {"0", "1"}


def _each_server_answer(url: str, route: str, body: dict[str, object]) -> dict[str, object]:
    """The same request until both servers answered it: the JSON (or, streamed, the parsed
    chunks) by server index."""
    answers: dict[str, object] = {}
    deadline = time.monotonic() + 60
    while set(answers) != {"0", "1"}:
        assert time.monotonic() < deadline, f"only {sorted(answers)} answered"
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}{route}", json=body) as r:
            assert r.status_code == 200, r.read()
            if body.get("stream"):
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                answer: object = [json.loads(data) for data in lines if data != "[DONE]"]
            else:
                answer = json.loads(r.read())
            answers[r.headers["x-rankcast-api-server"]] = answer
    return answers


def _with_chat_template(tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with the embedded model's chat template beside it (links to the rest):
    the template the Rust server renders."""
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_llama_dir.iterdir():
        (model / item.name).symlink_to(item)
    template = (embedded_model_dir / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(template)
    return model


def _streamed_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The logprobs of a stream's chunks put together (each chunk carries its tokens')."""
    joined: dict[str, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key, values in (choice.get("logprobs") or {}).items():
                joined.setdefault(key, []).extend(values)
    return joined


def test_logprobs_are_the_python_servers_whole_and_streamed(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path: Path
) -> None:
    """Chat's `logprobs` + `top_logprobs` and the completions API's `logprobs: k`, whole and
    streamed, equal on both kinds of server (token texts, values, alternatives, offsets)."""
    model = _with_chat_template(tiny_llama_dir, embedded_model_dir, tmp_path)
    server = ServerProcess(
        *tiny_model_args(model),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cases = [
        ("/v1/completions", {**common, "prompt": "Once upon a time", "logprobs": 3}, False, 3),
        (
            "/v1/chat/completions",
            {**common, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
             "top_logprobs": 2},
            True,
            2,
        ),
    ]  # fmt: skip
    with server.running():
        for route, body, chat, top in cases:
            whole = _each_server_answer(server.url, route, body)
            python, rust = (whole[s]["choices"][0]["logprobs"] for s in ("0", "1"))  # type: ignore[index]
            assert rust == python, route
            positions = python["content"] if chat else python["top_logprobs"]
            assert len(positions) == 6
            if chat:
                assert all(len(p["top_logprobs"]) == top for p in positions)
            else:
                assert all(len(p) == top for p in positions)
                assert python["text_offset"][0] == 0
            streamed = _each_server_answer(server.url, route, {**body, "stream": True})
            for index, chunks in streamed.items():
                joined = _streamed_logprobs(chunks)  # type: ignore[arg-type]
                assert joined == python, f"server {index}, {route}, streamed"


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Arguments in an order JSON libraries like to sort, a float Python spells its own way, text
# beyond ASCII: the Rust server must write them back as Python's json.dumps does.
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "at": 1e-05, "unit": "°C"}}'
THOUGHT_AND_CALL = (
    f"<think>\nNeeds the weather.\n</think>\n\nLet me check.\n<tool_call>\n{CALL}\n</tool_call>"
)


def _each_server_raw(url: str, route: str, body: dict[str, Any]) -> dict[str, str]:
    """The same request until both servers answered it: each one's body as it came, with
    what must differ between two answers (response ids, times, tool call ids) replaced."""
    answers: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while set(answers) != {"0", "1"}:
        assert time.monotonic() < deadline, f"only {sorted(answers)} answered"
        # A fresh connection each time, so the kernel spreads them over the servers.
        response = httpx.post(f"{url}{route}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        text = response.content.decode()
        calls = re.findall(r'"id":"(call_[^"]*)"', text)
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", c) for c in calls), calls
        text = re.sub(r'"id":"(chat)?cmpl-[^"]+"', '"id":"ID"', text)
        text = re.sub(r'"created":\d+', '"created":0', text)
        text = re.sub(r'"id":"call_[0-9a-f]{24}"', '"id":"CALL"', text)
        answers[response.headers["x-rankcast-api-server"]] = text
    return answers


def _chunks(stream: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in stream.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(data) for data in events[:-1]]


def test_reasoning_and_tool_calls_are_the_python_servers_to_the_byte(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path: Path
) -> None:
    """A fleet of one Python and one Rust API server started with `--reasoning-parser qwen3
    --enable-auto-tool-choice --tool-call-parser hermes`: the same chat, its output forced
    by a one-string `choice` (reasoning, content and a tool call, a reasoning cut short, a
    malformed call, calls left to the template by tool_choice none, chat_template_kwargs),
    whole and streamed, with and without logprobs, gives the same bytes from both servers,
    ids and times aside: field names and order, the parsed message, the chunks each stream is
    cut into, the finish reasons, the arguments JSON. The Python answer is checked for what
    it must say, so that the two cannot agree on a wrong one."""
    model = _with_chat_template(tiny_llama_dir, embedded_model_dir, tmp_path)
    server = ServerProcess(
        *tiny_model_args(
            model,
            "--max-model-len",
            "512",
            *PARSER_FLAGS,
        ),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )

    def chat(output: str, **extra: Any) -> dict[str, Any]:
        forced = {"structured_outputs": {"choice": [output]}}
        return {"messages": ASK, "max_tokens": 120, "temperature": 0, **forced, **extra}

    malformed = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    usage = {"stream_options": {"include_usage": True}}
    logprobs = {"logprobs": True, "top_logprobs": 2}
    cases = [
        chat(THOUGHT_AND_CALL, tools=TOOLS),
        chat(THOUGHT_AND_CALL, tools=TOOLS, **logprobs),
        chat("<think>Still thinking"),
        chat(malformed, tools=TOOLS),
        chat(f"<tool_call>{CALL}</tool_call>", tools=TOOLS, tool_choice="none"),
        chat("why</think>Paris", chat_template_kwargs={"enable_thinking": False}),
    ]
    with server.running():
        answers = []
        for body in cases:
            whole = _each_server_raw(server.url, "/v1/chat/completions", body)
            assert whole["1"] == whole["0"], body
            streamed = _each_server_raw(
                server.url, "/v1/chat/completions", {**body, "stream": True, **usage}
            )
            assert streamed["1"] == streamed["0"], body
            answers.append((json.loads(whole["0"]), _chunks(streamed["0"])))
        # A completion, with logprobs: the other route's fields and chunks, the same way.
        completion = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        for body in (completion, {**completion, "logprobs": 2, "stream": True, **usage}):
            both = _each_server_raw(server.url, "/v1/completions", {**body, "ignore_eos": True})
            assert both["1"] == both["0"], body

    (whole, chunks), (logged, _) = answers[0], answers[1]
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert list(message) == ["role", "content", "reasoning", "reasoning_content", "tool_calls"]
    assert message["content"] == "Let me check."
    assert message["reasoning"] == message["reasoning_content"] == "Needs the weather."
    (call,) = message["tool_calls"]
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "at": 1e-05, "unit": "°C"}',
    }
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert len([d for d in deltas if "reasoning_content" in d]) > 1, "reasoning streams"
    assert next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]["id"] == "CALL"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert len(logged["choices"][0]["logprobs"]["content"]) == whole["usage"]["completion_tokens"]
    cut = answers[2][0]["choices"][0]["message"]
    assert (cut["content"], cut["reasoning_content"]) == (None, "Still thinking")
    assert answers[3][0]["choices"][0]["message"]["content"] == malformed
    left = answers[4][0]["choices"][0]
    assert left["message"]["content"] == f"<tool_call>{CALL}</tool_call>"
    assert "tool_calls" not in left["message"] and left["finish_reason"] == "stop"
    # SmolLM2's template reads no enable_thinking (nor opens `<think>`): the variable is taken
    # and changes nothing, and a `</think>` the model did not open is text.
    closed = answers[5][0]["choices"][0]["message"]
    assert (closed["content"], closed["reasoning_content"]) == ("why</think>Paris", None)


# " 20 °C" and a token of the first byte of "°" alone.
DEGREES = [216, 34, 32, 13518, 51, 141]


def _from_each_server(
    url: str,
    method: str,
    route: str,
    body: dict[str, Any] | None = None,
    with_allow: bool = False,
) -> dict[str, tuple[Any, ...]]:
    """The same request until both servers answered it: each one's status and body as it
    came, the request id (which must differ between two answers) replaced; `with_allow`: and
    its `Allow` header."""
    answers: dict[str, tuple[Any, ...]] = {}
    deadline = time.monotonic() + 60
    while set(answers) != {"0", "1"}:
        assert time.monotonic() < deadline, f"only {sorted(answers)} answered {route}"
        # A fresh connection each time, so the kernel spreads them over the servers.
        response = httpx.request(method, f"{url}{route}", json=body, timeout=60)
        text = re.sub(r'"request_id":"[^"]+"', '"request_id":"ID"', response.content.decode())
        answer: tuple[Any, ...] = (response.status_code, text)
        if with_allow:
            answer += (response.headers.get("allow"),)
        answers[response.headers["x-rankcast-api-server"]] = answer
    return answers


def _load_of(url: str, server: str) -> dict[str, int]:
    """`/load` as API server `server` answers it (fresh connections until it does)."""
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, f"server {server} never answered /load"
        response = httpx.get(f"{url}/load", timeout=10)
        if response.headers["x-rankcast-api-server"] == server:
            assert response.status_code == 200
            load: dict[str, int] = response.json()
            return load


def test_tokenizer_render_and_discovery_routes_are_the_python_servers_to_the_byte(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path: Path
) -> None:
    """/tokenize, /detokenize, both render routes, /kv_event_sources, /get_server_info, /load,
    /ping and /version answer the same bytes (request ids aside) from a Python and a Rust API
    server, valid requests and refused ones alike: the status, the error's message and the
    field it names. The discovery routes read what the launcher hands the Rust server
    (--block-size, --kv-events-config, --speculative-config), each checked for what it must
    say so that the two cannot agree on a wrong answer; /load counts the Rust server's
    completions in flight as vLLM's counts them."""
    model = _with_chat_template(tiny_llama_dir, embedded_model_dir, tmp_path)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    kv_events = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"}
    server = ServerProcess(
        *tiny_model_args(
            model,
            "--served-model-name", MODEL,
            "--block-size", "32",
            "--kv-events-config", json.dumps(kv_events),
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        ),
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )  # fmt: skip
    parts = [{"type": "text", "text": "Weather at "}, {"type": "text", "text": "20 °C?"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    valid: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}),
        ("POST", "/tokenize", {"messages": chat, "add_generation_prompt": False}),
        ("POST", "/tokenize", {"messages": ASK, "add_special_tokens": True, "model": MODEL}),
        ("POST", "/detokenize", {"tokens": [1, 9690, 198, 6403, 1980, 253, 655, 2, *DEGREES]}),
        ("POST", "/v1/chat/completions/render", {"messages": ASK, "stream": True}),
        (
            "POST",
            "/v1/chat/completions/render",
            {"messages": chat, "temperature": 0, "max_tokens": 5, "stop": ["\n"], "seed": 7,
             "logprobs": True, "top_logprobs": 2, "guided_choice": ["yes", "no"]},
        ),
        (
            "POST",
            "/v1/completions/render",
            {"prompt": "Once upon a time", "temperature": 0.7, "top_p": 0.9, "top_k": 5,
             "min_p": 0.05, "logprobs": 2, "ignore_eos": True},
        ),
        ("POST", "/v1/completions/render", {"prompt": [1, 2, 3], "max_tokens": 500}),
        ("GET", "/kv_event_sources", None),
        ("GET", "/get_server_info", None),
        ("GET", "/load", None),
        ("GET", "/version", None),
    ]  # fmt: skip
    long = "a " * 600  # more tokens than the model's 512
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    refused: list[tuple[str, dict[str, Any], int]] = [
        ("/tokenize", {"prompt": "a", "messages": ASK}, 400),
        ("/tokenize", {"messages": [{"role": "bot"}, {"role": "user", "content": 5}]}, 400),
        ("/tokenize", {"messages": [{"role": "user", "content": [image, {"type": "text"}]}]}, 400),
        ("/tokenize", {"messages": []}, 400),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no?", "return_token_strs": None}, 400),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"messages": []}}, 400),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404),
        ("/detokenize", {"tokens": [1, 10**9]}, 400),
        ("/detokenize", {"tokens": [1, "x", 2.5, -1]}, 400),
        ("/detokenize", {}, 400),
        ("/v1/chat/completions/render", {"messages": []}, 400),
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": long}]}, 400),
        ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 600}, 400),
        ("/v1/completions/render", {"prompt": [5, 99999999]}, 400),
        ("/v1/completions/render", {"prompt": [""]}, 400),
        ("/v1/completions/render", {"prompt": [5, -1, "x"]}, 400),
        ("/v1/completions/render", {"prompt": ""}, 400),
    ]  # fmt: skip
    with server.running():
        answers = []
        for method, route, body in valid:
            both = _from_each_server(server.url, method, route, body)
            assert both["1"] == both["0"], (route, body, both)
            status, text = both["0"]
            assert status == 200, (route, text)
            answers.append(json.loads(text))
        for route, body, status in refused:
            both = _from_each_server(server.url, "POST", route, body)
            assert both["1"] == both["0"], (route, body, both)
            assert both["0"][0] == status, (route, both["0"])
        for method in ("GET", "POST"):
            pings = _from_each_server(server.url, method, "/ping")
            assert pings == {"0": (200, ""), "1": (200, "")}, pings
        # The schema: the Python servers' document less the routes the Rust server lacks.
        schemas = _from_each_server(server.url, "GET", "/openapi.json")
        assert schemas["0"][0] == schemas["1"][0] == 200
        python = json.loads(schemas["0"][1])
        assert set(RUST_UNSERVED) & set(python["paths"])  # so the check below removes some
        for route in RUST_UNSERVED:
            python["paths"].pop(route, None)
        assert schemas["1"][1].encode() == rendered(python), (
            "the Rust server's /openapi.json is not the Python servers' (less the routes it does "
            "not serve): run `python -m rankcast.api_server.openapi_document` and rebuild"
        )
        # A method a route does not take: 405 naming those it does, in the route's API shape.
        for method, route, allow in [
            ("TRACE", "/version", "GET"),
            ("PUT", "/v1/responses/resp_1", "GET"),
            ("HEAD", "/v1/responses/resp_1", "GET"),
            ("GET", "/v1/messages", "POST"),
            ("DELETE", "/v1/chat/completions", "POST"),
        ]:
            both = _from_each_server(server.url, method, route, with_allow=True)
            assert both["1"] == both["0"], (method, route, both)
            assert both["0"][0] == 405 and both["0"][2] == allow, (method, route, both)
        # A completion in flight on the Rust server is its load, and only its.
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "/load never counted the Rust server's stream"
            stream = StreamedCompletion(server.url, model=MODEL, max_tokens=480)
            assert stream.first.wait(60), "the stream should be running"
            if stream.server == "1":
                load = _load_of(server.url, "1")
                if load == {"server_load": 1}:
                    break
            stream.cancel()
        assert _load_of(server.url, "0") == {"server_load": 0}
        stream.cancel()
        while _load_of(server.url, "1") != {"server_load": 0}:
            assert time.monotonic() < deadline, "a cancelled stream still counts as load"
            time.sleep(0.1)

    prompt, unopened, counted, text, chat_render, shaped, sampled, ids, sources, info = answers[:10]
    assert prompt["count"] == len(prompt["tokens"]) == 4 and prompt["max_model_len"] == 512
    assert prompt["token_strs"] == ["Once", "\u0120upon", "\u0120a", "\u0120time"]
    # The template's turns without the assistant's opening, which the render adds.
    assert unopened["token_strs"] is None
    assert shaped["token_ids"][: unopened["count"]] == unopened["tokens"]
    assert len(shaped["token_ids"]) > unopened["count"]
    assert counted["tokens"] == chat_render["token_ids"]
    # Special tokens kept; a token that ends inside a character is U+FFFD.
    assert text == {"prompt": "<|im_start|>system\nOnce upon a time<|im_end|> 20 °C\ufffd"}
    assert chat_render["sampling_params"] == {
        "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "max_tokens": None
    }  # fmt: skip
    assert chat_render["stream"] is True and chat_render["model"] == MODEL
    assert shaped["sampling_params"]["structured"] == {"choice": ["yes", "no"]}
    assert sampled[0]["sampling_params"]["top_k"] == 5 and ids[0]["token_ids"] == [1, 2, 3]
    assert sources == {"0": {**sources["0"], "endpoint": endpoint, "topic": "kv"}}
    config = info["vllm_config"]
    assert config["cache_config"]["block_size"] == 32
    assert config["kv_events_config"]["endpoint"] == endpoint
    assert config["speculative_config"]["method"] == "ngram"
    assert answers[10] == {"server_load": 0}


@pytest.fixture(scope="module")
def fleet(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One Python and one Rust API server over the tiny model with a chat template, shared by
    the tests below that need no flags of their own."""
    model = _with_chat_template(tiny_llama_dir, embedded_model_dir, tmp_path_factory.mktemp("m"))
    server = ServerProcess(
        *tiny_model_args(model), api_server_count=1, rust_api_server_count=1, env=frontend_env()
    )
    with server.running():
        yield server


def _per_choice(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream as each choice's own chunks in order, and its usage: the samples' chunks
    interleave as their outputs happen to come, each choice's own sequence does not."""
    choices: dict[int, list[dict[str, Any]]] = {}
    usage = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            choices.setdefault(choice["index"], []).append(choice)
        usage = chunk.get("usage") or usage
    return {"choices": choices, "usage": usage}


def _answered(answer: dict[str, Any]) -> dict[str, Any]:
    """What a whole answer says, ids and times aside."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


PROMPT = "Once upon a time"


def test_samples_best_of_and_echo_are_the_python_servers_whole_and_streamed(
    fleet: ServerProcess,
) -> None:
    """`n` seeded samples (chat and completions, with and without logprobs), `best_of` (the
    likeliest `n` of more samples) and `echo` (the prompt's text first; with logprobs, its
    tokens scored, the first one `null`) give the same choices, texts, logprobs, finish
    reasons and usage on a Python and a Rust API server, whole and streamed; refusals of
    these fields are the same 400s. The Python answers are checked for what they must say, so
    that the two cannot agree on a wrong one."""
    sampled = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}
    usage = {"stream_options": {"include_usage": True}}
    ask = [{"role": "user", "content": "Tell me a story"}]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": PROMPT, "n": 3, "seed": 7, **sampled}),
        ("/v1/completions", {"prompt": PROMPT, "n": 2, "seed": 3, "logprobs": 2, **sampled}),
        ("/v1/chat/completions", {"messages": ask, "n": 3, "seed": 5, **sampled}),
        (
            "/v1/chat/completions",
            {"messages": ask, "n": 2, "seed": 9, "logprobs": True, "top_logprobs": 2,
             **sampled},
        ),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0}),
        (
            "/v1/completions",
            {"prompt": PROMPT, "echo": True, "logprobs": 2, "n": 2, "seed": 1, **sampled},
        ),
        (
            "/v1/completions",
            {"prompt": [1, 9690, 198], "echo": True, "logprobs": 1, "seed": 6, **sampled},
        ),
        ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 2, "seed": 4, **sampled}),
    ]  # fmt: skip
    ranked = [
        {"prompt": PROMPT, "n": 2, "best_of": 4, "seed": 11, "logprobs": 1, **sampled},
        {"prompt": PROMPT, "n": 1, "best_of": 3, "seed": 2, **sampled},
        {"prompt": PROMPT, "best_of": 2, "seed": 8, "echo": True, "logprobs": 0, **sampled},
    ]
    whole: dict[str, dict[str, Any]] = {}
    for route, body in cases + [("/v1/completions", body) for body in ranked]:
        both = _each_server_answer(fleet.url, route, body)
        python, rust = (_answered(both[s]) for s in ("0", "1"))  # type: ignore[arg-type]
        assert rust == python, (route, body)
        whole[json.dumps(body)] = python
        if body.get("best_of", 1) > body.get("n", 1):
            continue  # ranked answers cannot stream
        streamed = _each_server_answer(fleet.url, route, {**body, "stream": True, **usage})
        python_chunks, rust_chunks = (
            _per_choice(streamed[s])  # type: ignore[arg-type]
            for s in ("0", "1")
        )
        assert rust_chunks == python_chunks, (route, body, "streamed")
        assert python_chunks["usage"] == python["usage"], (route, body)
        assert sorted(python_chunks["choices"]) == list(range(len(python["choices"])))

    # What the answers must say.
    n3, n2_logprobs, chat3, chat2_logprobs, echoed, echoed_scored, echoed_ids, even = (
        whole[json.dumps(body)] for _, body in cases
    )
    texts = [c["text"] for c in n3["choices"]]
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert n3["usage"]["completion_tokens"] == 18  # every sample counted
    assert len({c["message"]["content"] for c in chat3["choices"]}) == 3
    for choice in chat2_logprobs["choices"]:
        assert len(choice["logprobs"]["content"]) == 6
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in n2_logprobs["choices"])
    prompt_tokens = echoed["usage"]["prompt_tokens"]
    assert echoed["choices"][0]["text"].startswith(PROMPT)
    assert echoed["choices"][0]["logprobs"] is None
    for choice in echoed_scored["choices"]:
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(PROMPT)
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert len(logprobs["tokens"]) == prompt_tokens + 6
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][1:])
        assert logprobs["text_offset"][prompt_tokens] == len(PROMPT)
    # Both samples scored the same prompt the same way (the first sample's scores).
    first, second = (c["logprobs"] for c in echoed_scored["choices"])
    assert first["token_logprobs"][:prompt_tokens] == second["token_logprobs"][:prompt_tokens]
    assert echoed_ids["usage"]["prompt_tokens"] == 3
    assert len(echoed_ids["choices"][0]["logprobs"]["tokens"]) == 3 + 6
    assert len(even["choices"]) == 2
    best_two, best_one, best_echoed = (whole[json.dumps(body)] for body in ranked)
    assert len(best_two["choices"]) == 2 and best_two["usage"]["completion_tokens"] == 24
    likelihoods = [sum(c["logprobs"]["token_logprobs"]) for c in best_two["choices"]]
    assert likelihoods[0] >= likelihoods[1], likelihoods
    assert len(best_one["choices"]) == 1 and best_one["choices"][0]["logprobs"] is None
    assert best_echoed["choices"][0]["text"].startswith(PROMPT)

    refused: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": PROMPT, "n": 0}),
        ("/v1/completions", {"prompt": PROMPT, "n": 129, "best_of": "x", "echo": "maybe"}),
        ("/v1/completions", {"prompt": PROMPT, "n": 3, "best_of": 2}),
        ("/v1/completions", {"prompt": PROMPT, "best_of": 3, "stream": True}),
        ("/v1/chat/completions", {"messages": ask, "n": 200}),
    ]
    for route, body in refused:
        answers = _from_each_server(fleet.url, "POST", route, body)
        assert answers["1"] == answers["0"], (route, body, answers)
        assert answers["0"][0] == 400, (route, answers["0"])


def _request_counts(text: str) -> dict[tuple[str, str, str], float]:
    """`http_requests_total` of an exposition, by (handler, method, status)."""
    counts = {}
    for line in text.splitlines():
        if line.startswith("http_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
            key = (labels["handler"], labels["method"], labels["status"])
            counts[key] = float(line.rsplit(" ", 1)[1])
    return counts


def test_requests_are_counted_by_route_alike_on_every_server(fleet: ServerProcess) -> None:
    """vLLM's `http_requests_total{handler,method,status}`: requests to every route (the
    Responses and Messages ones among them, answered or refused) are counted by route template
    and status class over the whole fleet, a path no route takes as "none", and a scrape of
    either server shows the same counts."""
    user = [{"role": "user", "content": "Hi"}]
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
        ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 0}),
        ("POST", "/v1/messages", {"max_tokens": 2, "messages": user}),
        ("POST", "/v1/messages", {"messages": user}),
        ("POST", "/v1/messages/count_tokens", {"messages": user}),
        ("POST", "/v1/messages/count_tokens", {"messages": []}),
        ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("POST", "/v1/completions", {"prompt": PROMPT, "n": 0}),
        ("GET", "/v1/models/nope", None),
        ("GET", "/v1/nowhere", None),
    ]
    templates = {"/v1/models/nope": "/v1/models/{model_id:path}"}
    before = _request_counts(scrape_each(fleet.url, 2)["0"])
    wanted = dict(before)
    statuses: dict[str, set[int]] = {}
    for method, route, body in requests:
        answered: set[str] = set()
        deadline = time.monotonic() + 60
        while answered != {"0", "1"}:  # fresh connections until both servers answered
            assert time.monotonic() < deadline, f"only {sorted(answered)} answered {route}"
            response = httpx.request(method, f"{fleet.url}{route}", json=body, timeout=60)
            server, status = response.headers["x-rankcast-api-server"], response.status_code
            answered.add(server)
            # A server without the route answers as for any path it has no route for.
            message = response.json()["error"]["message"] if status == 404 else ""
            unmatched = message in ("Not Found", f"no route {route}")
            handler = "none" if unmatched else templates.get(route, route)
            key = (handler, method, f"{status // 100}xx")
            wanted[key] = wanted.get(key, 0.0) + 1
            if server == "0":
                statuses.setdefault(route, set()).add(status)
    # The Python server answers every route: each was counted answered and refused.
    for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert statuses[route] == {200, 400}, (route, statuses[route])
    deadline = time.monotonic() + 30
    while True:
        counts = {s: _request_counts(t) for s, t in scrape_each(fleet.url, 2).items()}
        if counts["0"] == counts["1"] == wanted:
            break
        assert time.monotonic() < deadline, f"counted {counts}, wanted {wanted}"
        time.sleep(0.2)
    for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert wanted[(route, "POST", "2xx")] >= before.get((route, "POST", "2xx"), 0) + 1
        assert wanted[(route, "POST", "4xx")] >= before.get((route, "POST", "4xx"), 0) + 1
    assert wanted[("/v1/models/{model_id:path}", "GET", "4xx")] >= 2
    assert wanted[("none", "GET", "4xx")] >= 2
