"""Deprecated: the notification types moved to `rankcast.channel` (and `publish` with them).

Kept for one release so an extension written against an earlier README still imports; each
name it is asked for warns once with the import to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import rankcast.channel as _channel
import rankcast.channel.events as _events

_RENAMED = {"publish_worker_notification": "publish"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name, name)
    for module in (_channel, _events):
        if hasattr(module, new):
            warnings.warn(
                f"rankcast.notifications.{name} is deprecated; use "
                f"`from {module.__name__} import {new}`",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, new)
    raise AttributeError(f"module 'rankcast.notifications' has no attribute {name!r}")
