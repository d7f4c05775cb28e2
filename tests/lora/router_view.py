"""What a router sees of a multi-server deployment: one response per API server behind the
shared port, and the running/waiting adapter sets read by the routers' rules."""

from __future__ import annotations

import re
import time

import httpx


def each_server(
    url: str, count: int, path: str, timeout_s: float = 30
) -> dict[str, httpx.Response]:
    """GET `path` until every one of `count` API servers answered; keyed by server index."""
    seen: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < count:
        assert time.monotonic() < deadline, f"reached only API servers {sorted(seen)}"
        with httpx.Client(timeout=30) as http:
            response = http.get(f"{url}{path}")
        seen[response.headers["x-rankcast-api-server"]] = response
    return seen


def requests_info(text: str) -> dict[str, list[str]]:
    """Of the `vllm:lora_requests_info` series, the one with the largest value wins; its adapter
    lists are comma-separated (the rule llm-d and the Gateway API inference extension follow)."""
    best, labels = -1.0, {}
    for line in text.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            value = float(line.rsplit(" ", 1)[1])
            if value > best:
                best, labels = value, dict(re.findall(r'(\w+)="([^"]*)"', line))
    return {
        key: [a for a in labels.get(f"{key}_lora_adapters", "").split(",") if a]
        for key in ("running", "waiting")
    }
