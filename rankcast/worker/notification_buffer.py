"""Deprecated: the worker's notification buffer moved to `rankcast.channel.buffer`, and
`publish_worker_notification` is `rankcast.channel.publish`.

Kept for one release so an extension written against an earlier README still imports; each
name it is asked for warns with the import to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import rankcast.channel.buffer as _buffer

_RENAMED = {"publish_worker_notification": "publish"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name, name)
    if not hasattr(_buffer, new):
        raise AttributeError(
            f"module 'rankcast.worker.notification_buffer' has no attribute {name!r}"
        )
    where = "rankcast.channel" if new == "publish" else "rankcast.channel.buffer"
    warnings.warn(
        f"{__name__}.{name} is deprecated; use `from {where} import {new}`",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_buffer, new)
