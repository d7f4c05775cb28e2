"""A real `rankcast serve` of the embedded model, two API servers, driven by the openai client."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.notification_clients import prefix_cache_totals
from tests.entrypoints.server_process import ServerProcess

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
ENGINE_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--kv-cache-space",
        "0.25",
        "--max-num-seqs",
        "16",
    )
    with proc.running():
        yield proc


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _fresh_get(url: str, path: str, **kwargs) -> httpx.Response:
    """A new connection each time, so SO_REUSEPORT may hand it to either API server."""
    with httpx.Client(timeout=30) as http:
        return http.get(f"{url}{path}", **kwargs)


def _engine_lines(metrics: str) -> list[str]:
    return sorted(line for line in metrics.splitlines() if line.startswith(ENGINE_SERIES))


def test_chat_answers_paris_with_correct_usage(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    from rankcast.model_files.source import resolve_model
    from rankcast.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None).model_dir)
    assert response.usage.prompt_tokens == len(apply_chat_template(tokenizer, messages))
    # The completion counts every generated token, the end-of-turn token included.
    text_tokens = len(
        tokenizer.encode(response.choices[0].message.content or "", add_special_tokens=False)
    )
    assert response.usage.completion_tokens in (text_tokens, text_tokens + 1)
    assert (
        response.usage.total_tokens
        == response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_streaming_chat_answers_paris_and_reports_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "Paris" in text and finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_completions_with_max_tokens_and_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    choice = response.choices[0]
    assert "Paris" in choice.text
    assert response.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 6 and len(choice.logprobs.top_logprobs[0]) == 2
    # text_offset: where each token's text starts in the completion.
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0
    assert offsets == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(6)]
    stream = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        logprobs=2,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    # A stream's offsets go on from chunk to chunk, as if it were one response.
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert streamed == offsets


def test_tokenize_and_detokenize_in_vllms_shapes(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    text = "The capital of France is"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        prompt = http.post(
            "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
        ).json()
        back = http.post("/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]})
        rendered = http.post("/tokenize", json={"messages": chat}).json()
        special = http.post("/tokenize", json={"messages": chat, "add_special_tokens": True})
        refusals = {
            "bad id": http.post("/detokenize", json={"tokens": [10**9]}),
            "both inputs": http.post("/tokenize", json={"prompt": "a", "messages": chat}),
            "unknown model": http.post("/tokenize", json={"model": "nope", "prompt": "a"}),
        }
    assert prompt["count"] == len(prompt["tokens"]) == len(prompt["token_strs"])
    assert prompt["max_model_len"] == 1024 and rendered["token_strs"] is None
    assert back.json() == {"prompt": text}
    # The counts are the ones the completions bill as prompt tokens.
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == prompt["count"]
    answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    assert answer.usage.prompt_tokens == rendered["count"]
    # Special tokens on a rendered chat are the tokenizer's post-processing of its text
    # (none for this model: the template writes them).
    assert special.status_code == 200 and special.json()["tokens"] == rendered["tokens"]
    assert refusals["bad id"].status_code == 400
    assert refusals["bad id"].json()["error"]["param"] == "tokens"
    assert refusals["both inputs"].status_code == 400
    assert "either prompt or messages" in refusals["both inputs"].json()["error"]["message"]
    assert refusals["unknown model"].status_code == 404


def _loads(url: str) -> dict[str, object]:
    """`/load` by API server: fresh connections until both answered."""
    loads: dict[str, object] = {}
    deadline = time.monotonic() + 30
    while len(loads) < 2:
        assert time.monotonic() < deadline, f"only servers {sorted(loads)} answered /load"
        response = _fresh_get(url, "/load")
        assert response.status_code == 200
        loads[response.headers["x-rankcast-api-server"]] = response.json()
    return loads


def test_ping_and_load_answer_as_vllms_do(server: ServerProcess) -> None:
    """vLLM's probes: /ping (GET and POST, no key) is /health's 200 with no body, and /load is
    each API server's completions in flight (`server_load`): the one streaming a completion
    counts it, the other does not, and neither once its client has left."""
    for method in ("GET", "POST"):
        with httpx.Client(timeout=30) as http:
            ping = http.request(method, f"{server.url}/ping")
        assert (ping.status_code, ping.content) == (200, b""), method
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 900, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(base_url=server.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        streaming = response.headers["x-rankcast-api-server"]
        lines = response.iter_lines()  # kept: dropping it would close the stream
        assert next(lines).startswith("data:")
        other = "1" if streaming == "0" else "0"
        loads = _loads(server.url)
        assert loads == {streaming: {"server_load": 1}, other: {"server_load": 0}}, loads
    deadline = time.monotonic() + 30
    while (loads := _loads(server.url))[streaming] != {"server_load": 0}:
        assert time.monotonic() < deadline, f"a request whose client left still counts: {loads}"
        time.sleep(0.1)


def test_seeded_sampling_over_http_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=11
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_requests_land_on_both_api_servers(server: ServerProcess) -> None:
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        response = _fresh_get(
            server.url, "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert response.status_code == 200
        seen.add(response.headers["x-rankcast-api-server"])
    assert seen == {"0", "1"}


def test_metrics_agree_across_api_servers_while_requests_run(server: ServerProcess) -> None:
    done = threading.Event()

    def long_request() -> None:
        """A long streamed completion, left (and so aborted) once the check is done."""
        body = {
            "model": MODEL,
            "prompt": "Write a long story:",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {API_KEY}"}
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            for _ in response.iter_lines():
                if done.is_set():
                    return

    workers = [threading.Thread(target=long_request) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + 120
        agreed = None
        while agreed is None and time.monotonic() < deadline:
            samples: dict[str, list[str]] = {}
            while len(samples) < 2 and time.monotonic() < deadline:
                response = _fresh_get(server.url, "/metrics")
                samples[response.headers["x-rankcast-api-server"]] = _engine_lines(response.text)
            first, second = samples.get("0"), samples.get("1")
            running = [line for line in first or [] if line.startswith("vllm:num_requests_running")]
            if first and first == second and running and not running[0].endswith(" 0.0"):
                agreed = first
        assert agreed is not None, "both API servers should report the same engine series"
        for name in ENGINE_SERIES:
            assert sum(line.startswith(name + "{") for line in agreed) == 1, name
    finally:
        done.set()
        for worker in workers:
            worker.join(180)


def test_bad_requests_get_openai_shaped_400s(server: ServerProcess, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        malformed = http.post("/v1/chat/completions", content=b'{"messages": [')
        assert malformed.status_code == 400
        assert malformed.json()["error"]["type"] == "BadRequestError"
        assert "JSON" in malformed.json()["error"]["message"]
    chat = [{"role": "user", "content": "hi"}]
    for kwargs, field in (
        (dict(temperature=5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=129), "n"),
        (dict(top_logprobs=50, logprobs=True), "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model=MODEL, messages=chat, **kwargs)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 1500, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=chat)


def test_api_key_is_required(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert _fresh_get(server.url, "/v1/models").status_code == 401
    assert _fresh_get(server.url, "/health").status_code == 200, "health needs no key"


def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": MODEL,
        "prompt": "Count forever:",
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        chunks = response.iter_lines()
        assert any(line.startswith("data:") for line in (next(chunks), next(chunks)))
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = _engine_lines(_fresh_get(server.url, "/metrics").text)
        if any(
            line.startswith("vllm:num_requests_running") and line.endswith(" 0.0") for line in lines
        ):
            return
        time.sleep(0.2)
    raise AssertionError("the engine kept running a request whose client left")


ENGINE_LOAD_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def test_engine_death_makes_every_api_server_answer_503() -> None:
    proc = ServerProcess("--max-model-len", "1024", "--kv-cache-space", "0.25")
    try:
        proc.wait_healthy()
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)
        errors: list[BaseException] = []
        streaming = threading.Event()

        def in_flight() -> None:
            try:
                stream = client.completions.create(
                    model=MODEL,
                    prompt="Tell a long story",
                    max_tokens=900,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    streaming.set()
            except Exception as exc:
                errors.append(exc)

        worker = threading.Thread(target=in_flight)
        worker.start()
        assert streaming.wait(60), "the request should be streaming before the engine dies"
        os.kill(proc.pid_of("engine_core_dp0"), signal.SIGKILL)
        killed = time.monotonic()
        unhealthy: set[str] = set()
        while len(unhealthy) < 2 and time.monotonic() - killed < 5:
            response = _fresh_get(proc.url, "/health")
            if response.status_code == 503:
                unhealthy.add(response.headers["x-rankcast-api-server"])
        assert unhealthy == {"0", "1"}, "both API servers must report the dead engine within 5 s"
        # Nothing reports load that no longer exists: a router must not send traffic by it.
        scraped: dict[str, str] = {}
        while len(scraped) < 2:
            assert time.monotonic() - killed < 10, f"scraped only {sorted(scraped)}"
            response = _fresh_get(proc.url, "/metrics")
            scraped[response.headers["x-rankcast-api-server"]] = response.text
        for text in scraped.values():
            assert 'rankcast:engine_up{engine="0"} 0.0' in text
            for name in ENGINE_LOAD_SERIES:
                (line,) = [x for x in text.splitlines() if x.startswith(name + "{")]
                assert line.endswith(" 0.0"), line
        worker.join(10)
        assert not worker.is_alive(), "the in-flight stream must end, not hang"
        assert errors and isinstance(errors[0], openai.APIError)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    finally:
        leftovers = proc.stop()
    assert leftovers == []


def test_prefix_cache_counters_are_the_engines_on_every_api_server(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """A shared prefix is found in the cache, and both API servers report the engine's own
    totals (not counts of their own), so Prometheus sees one counter whichever answers."""
    system = "You are a terse assistant who answers in one word. " * 6
    for question in ("Sky color?", "Grass color?", "Snow color?"):
        client.completions.create(model=MODEL, prompt=system + question, max_tokens=2)

    deadline = time.monotonic() + 60
    samples: dict[str, tuple[float, float]] = {}
    while time.monotonic() < deadline:
        response = _fresh_get(server.url, "/metrics")
        samples[response.headers["x-rankcast-api-server"]] = prefix_cache_totals(response.text)
        if len(samples) == 2 and len(set(samples.values())) == 1:
            break
    assert len(samples) == 2 and len(set(samples.values())) == 1, samples
    queries, hits = samples["0"]
    assert hits >= 2 * 64, "the second and third prompts found the shared prefix"
    assert queries > hits


def test_reset_prefix_cache_needs_the_key_and_empties_the_cache(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/reset_prefix_cache").status_code == 401
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = http.post("/reset_prefix_cache", headers=headers)
        assert response.status_code == 200 and response.json() == {"reset": [True]}
        prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. " * 4
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        for _ in range(2):
            assert http.post("/v1/completions", json=body, headers=headers).status_code == 200

    def totals() -> tuple[float, float]:
        text = _fresh_get(server.url, "/metrics").text
        values = [
            float(line.rsplit(" ", 1)[1])
            for name in ("vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{")
            for line in text.splitlines()
            if line.startswith(name)
        ]
        return values[0], values[1]

    queries, hits = totals()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.post("/reset_prefix_cache", headers=headers)
        assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    deadline = time.monotonic() + 30
    while totals()[0] == queries:  # until this server has the stats of that request
        assert time.monotonic() < deadline, "the request's lookup never showed in the metrics"
        time.sleep(0.1)
    assert totals()[1] == hits, "after a reset the same prompt finds nothing cached"


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage == plain.usage
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
    )
    chunks = [chunk.choices[0].text for chunk in streamed]
    assert chunks[0].startswith(prompt) and "".join(chunks) == echoed.choices[0].text

    # With logprobs the prompt's tokens are scored too (the first has nothing before it).
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2
    )
    alone = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    )
    got, own = scored.choices[0].logprobs, alone.choices[0].logprobs
    assert got is not None and own is not None and scored.usage is not None
    prompt_tokens = scored.usage.prompt_tokens
    assert len(got.tokens) == prompt_tokens + len(own.tokens)
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert all(lp <= 0 for lp in got.token_logprobs[1:prompt_tokens])
    assert "".join(got.tokens[:prompt_tokens]) == prompt
    assert got.tokens[prompt_tokens:] == own.tokens
    assert got.token_logprobs[prompt_tokens:] == own.token_logprobs
    assert got.text_offset[prompt_tokens:] == [len(prompt) + o for o in own.text_offset]
    assert got.text_offset == sorted(got.text_offset)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2,
        stream=True,
    )  # fmt: skip
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in streamed:
        part = chunk.choices[0].logprobs
        if part is not None:
            for key, values in joined.items():
                values.extend(getattr(part, key))
    assert joined == {key: getattr(got, key) for key in joined}


def test_n_samples_are_the_seeded_single_samples_and_share_the_prompts_blocks(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """Choice i of a seeded n-sample request is the single sample with seed + i (vLLM's
    rule), and samples after the first find the prompt's full blocks in the prefix cache."""
    prompt = f"Request {uuid.uuid4().hex}: write one sentence about the sea. " * 3

    def hits() -> float:
        return prefix_cache_totals(_fresh_get(server.url, "/metrics").text)[1]

    before = hits()
    many = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, seed=7, n=3, temperature=1.0
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, seed=7 + i, temperature=1.0
        ).choices[0]
        for i in range(3)
    ]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    assert many.usage is not None
    assert many.usage.completion_tokens == sum(
        len(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, seed=7 + i,
                                      temperature=1.0, logprobs=0).choices[0].logprobs.tokens)
        for i in range(3)
    )  # fmt: skip
    full_blocks = many.usage.prompt_tokens // 16 * 16
    deadline = time.monotonic() + 30
    while hits() < before + 2 * full_blocks:
        assert time.monotonic() < deadline, (before, hits(), full_blocks)
        time.sleep(0.05)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        seed=3,
        n=2,
        temperature=1.0,
        stream=True,
    )
    streamed: dict[int, str] = {}
    for chunk in chat:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    whole = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        seed=3,
        n=2,
        temperature=1.0,
    )
    assert streamed == {c.index: c.message.content for c in whole.choices}


def test_best_of_answers_the_most_likely_samples(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    drawn = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, seed=11, n=4, temperature=1.0, logprobs=0
    )
    best = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, seed=11, n=2, best_of=4, temperature=1.0
    )
    assert best.choices[0].logprobs is None  # not asked for, though ranked by them

    def likelihood(choice: Any) -> float:
        return sum(choice.logprobs.token_logprobs)

    ranked = sorted(drawn.choices, key=likelihood, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.usage is not None and drawn.usage is not None
    assert best.usage.completion_tokens == drawn.usage.completion_tokens
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="best_of"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **bad)
