"""What the expert-load events say: how many tokens each rank's mixture-of-experts layers routed
to each expert, so an operator sees an unbalanced expert placement on every API server.

Each rank of a mixture-of-experts model publishes, at most once a window
(`rankcast/worker/expert_load.py`), a `custom` notification with key `rankcast.expert_load` and
this payload (`ExpertLoad`):

    layers   the model's indices of the layers counted (this rank's MoE layers, ascending; a
             pipeline stage holds only its own)
    tokens   tokens[i][e]: the tokens layer layers[i] routed to expert e in the window (a token
             counts once for each of its top-k experts, so a row sums to tokens x k; with
             expert parallelism a rank counts only the experts it holds, 0 for the others)
    steps    the steps the window counted
    seconds  how long the window was open

A window larger than one notification may carry is split by layers (`expert_load_payloads`).
Every consumer adds `tokens` to its totals per (rank, layer, expert) by `read_expert_load`'s rule
(the engine view in Python and in Rust); a payload of another shape under this key is counted
among the notifications and otherwise skipped.
"""

from __future__ import annotations

from typing import Any

import msgspec

EXPERT_LOAD_KEY = "rankcast.expert_load"
# Counts per notification: a count is at most 9 bytes of msgpack, so 4096 of them stay well
# inside `MAX_NOTIFICATION_BYTES` (Qwen3-30B-A3B's 48 layers of 128 experts take two).
MAX_COUNTS_PER_NOTIFICATION = 4096


class ExpertLoad(msgspec.Struct):
    """One expert-load payload, as the module docstring describes it."""

    layers: list[int]
    tokens: list[list[int]]
    steps: int = 0
    seconds: float = 0.0


def expert_load_payloads(
    layers: list[int], tokens: list[list[int]], steps: int, seconds: float
) -> list[dict[str, Any]]:
    """One window's payloads: its layers in order, as many to a payload as fit
    `MAX_COUNTS_PER_NOTIFICATION`. A row that is not one count per expert of that layer, or a
    negative count, is refused here, naming it, rather than sent to every consumer."""
    if len(tokens) != len(layers):
        raise ValueError(f"tokens: {len(tokens)} rows for {len(layers)} layers")
    for layer, row in zip(layers, tokens, strict=True):
        if layer < 0:
            raise ValueError(f"layers: {layer} is not a layer index")
        if not row or any(count < 0 for count in row):
            raise ValueError(f"tokens[layer {layer}]: {row!r} is not a count per expert")
    per_payload = max(1, MAX_COUNTS_PER_NOTIFICATION // max(len(row) for row in tokens or [[0]]))
    return [
        msgspec.to_builtins(
            ExpertLoad(layers[i : i + per_payload], tokens[i : i + per_payload], steps, seconds)
        )
        for i in range(0, len(layers), per_payload)
    ]


def read_expert_load(payload: dict[str, Any]) -> list[tuple[int, list[int]]] | None:
    """(layer, tokens per expert) for each row of an expert-load payload; None when it is not
    one: `layers` a list of integers >= 0, `tokens` as many lists of integers >= 0 (booleans
    are not integers). `rust/frontend/src/view.rs` reads by the same rule."""
    layers, tokens = payload.get("layers"), payload.get("tokens")
    if not isinstance(layers, list) or not isinstance(tokens, list) or len(layers) != len(tokens):
        return None
    rows = []
    for layer, row in zip(layers, tokens, strict=True):
        if not _count(layer) or not isinstance(row, list) or not all(map(_count, row)):
            return None
        rows.append((layer, row))
    return rows


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63
