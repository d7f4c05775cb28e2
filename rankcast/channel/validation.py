"""Rule 1 of the notification channel: a notification is checked when it is published, so a bad
payload fails at its producer with an error naming the bad path, never in the engine or in a
consumer (docs/architecture.md)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rankcast.channel.events import MAX_NOTIFICATION_BYTES, WORKER_TYPES, CustomNotification


def _check_value(value: Any, path: str) -> None:
    """Raise naming `path` unless `value` is plain msgpack data (what every consumer can read)."""
    if value is None or isinstance(value, bool | str | bytes):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"{path}: integer {value} does not fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number (JSON consumers reject it)")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: key {key!r} is {type(key).__name__}, keys must be str")
            _check_value(item, f"{path}[{key!r}]")
        return
    raise TypeError(f"{path}: {type(value).__name__} is not msgpack-encodable plain data")


_SCALARS = frozenset({str, bool, bytes, type(None)})


def _is_plain(value: Any) -> bool:
    """The common case, fast: exact builtin types only, no paths kept. A False sends the
    value through `_check_value`, which names what is wrong (or accepts a subclass)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is int:
        return bool(-(2**63) <= value < 2**64)
    if kind is float:
        return math.isfinite(value)
    # Plain loops: a third faster than all() over a generator, on every publish.
    if kind is dict:
        for key, item in value.items():  # noqa: SIM110
            if type(key) is not str or not _is_plain(item):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:  # noqa: SIM110
            if not _is_plain(item):
                return False
        return True
    return False


def validate_notification(n: Any) -> int:
    """Check a notification before it is queued; return its encoded size."""
    if type(n) not in WORKER_TYPES:
        names = ", ".join(t.__name__ for t in WORKER_TYPES)
        raise TypeError(
            f"publish takes one of {names} (plugins use CustomNotification "
            f"with their own key), got {type(n).__name__}"
        )
    if isinstance(n, CustomNotification):
        if not isinstance(n.key, str) or not n.key:
            raise TypeError(f"notification key must be a non-empty str, got {n.key!r}")
        if not isinstance(n.payload, dict):
            raise TypeError(f"payload: must be a dict, got {type(n.payload).__name__}")
        if not _is_plain(n.payload):
            _check_value(n.payload, "payload")
    size = len(msgspec.msgpack.encode(n))
    if size > MAX_NOTIFICATION_BYTES:
        raise ValueError(
            f"notification {getattr(n, 'key', type(n).__name__)!r} is {size} bytes encoded; "
            f"the limit is {MAX_NOTIFICATION_BYTES}"
        )
    return size
