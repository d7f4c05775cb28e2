"""What the fault tests watch a fleet with: a streamed completion read on its own thread, and
the wait until every API server answers /health with a given status."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx


class StreamedCompletion:
    """A streamed completion read on its own thread, every SSE data line kept."""

    def __init__(self, url: str, max_tokens: int, model: str | None = None) -> None:
        self.events: list[str] = []
        self.first = threading.Event()
        self._cancelled = threading.Event()
        self.server: str | None = None  # the x-rankcast-api-server that answered
        body: dict[str, object] = {
            "prompt": "Tell a long story",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        if model is not None:
            body["model"] = model
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict[str, object]) -> None:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as response,
        ):
            self.server = response.headers.get("x-rankcast-api-server")
            for line in response.iter_lines():
                if self._cancelled.is_set():
                    return  # the connection closes: the server aborts the request
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()

    def cancel(self, timeout_s: float = 30.0) -> None:
        """Stop reading and close the connection (the request is aborted), and wait until the
        reader has."""
        self._cancelled.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "a cancelled stream's reader did not stop"

    def chunks(self) -> Iterator[dict[str, object]]:
        for event in self.events:
            if event != "[DONE]":
                yield json.loads(event)


def assert_cut_by_the_shutdown(stream: StreamedCompletion) -> None:
    """A stream that outlived --shutdown-timeout: tokens flowed, then a chunk with finish
    reason "abort", the error naming the timeout, and [DONE]."""
    chunks = list(stream.chunks())
    tokens = [c for c in chunks if c.get("choices")]
    assert len(tokens) > 1, "tokens flowed until the timeout"
    assert tokens[-1]["choices"][0]["finish_reason"] == "abort"  # type: ignore[index]
    error = chunks[-1]["error"]
    assert error["code"] == 503 and "--shutdown-timeout" in error["message"]  # type: ignore[index]
    assert stream.events[-1] == "[DONE]"


def until_every_server(url: str, servers: int, status: int, timeout_s: float) -> float:
    """Seconds until each of `servers` API servers has answered /health with `status` (new
    connections reach either); fails past `timeout_s`."""
    start = time.monotonic()
    seen: set[str] = set()
    while len(seen) < servers:
        elapsed = time.monotonic() - start
        assert elapsed < timeout_s, f"only API servers {sorted(seen)} answered {status}"
        with httpx.Client(timeout=5) as http:
            response = http.get(f"{url}/health")
        if response.status_code == status:
            seen.add(response.headers["x-rankcast-api-server"])
        time.sleep(0.05)
    return time.monotonic() - start
