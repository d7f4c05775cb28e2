"""User code inside every rank: `--worker-extension-cls` and `rankcast.worker_plugins` plugins.

An extension class is mixed into the Worker, so its methods are callable by name through
`collective_rpc` (and `LLM.collective_rpc`, `POST /collective_rpc`) and can publish
notifications from the rank that runs them. A plugin is an entry point in the group
`rankcast.worker_plugins`; each is called once with the worker, in every worker process, after
the model is loaded (a place to start a producer thread, say).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Any

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "rankcast.worker_plugins"


class ExtensionError(ValueError):
    """A worker extension or plugin cannot be used; the message names it."""


def import_class(spec: str) -> type:
    """`module:Class` (or `module.Class`) -> the class, with an error naming what is missing."""
    module_name, sep, qualname = spec.partition(":")
    if not sep:
        module_name, _, qualname = spec.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ExtensionError(f"cannot import worker extension {spec!r}: {exc}") from None
    if not isinstance(target, type):
        raise ExtensionError(f"worker extension {spec!r} is not a class")
    return target


def worker_class(base: type, extension_spec: str | None) -> type:
    """The Worker with the extension mixed in; a method that would shadow a Worker method is an
    error, because the engine calls those by name and must get the real ones."""
    if extension_spec is None:
        return base
    extension = import_class(extension_spec)
    clashes = sorted(
        name
        for name in vars(extension)
        if not name.startswith("__") and callable(getattr(extension, name)) and hasattr(base, name)
    )
    if clashes:
        raise ExtensionError(
            f"worker extension {extension_spec!r} defines {clashes}, which the Worker already has"
        )
    return type(f"{base.__name__}With{extension.__name__}", (base, extension), {})


def load_worker_plugins(worker: Any) -> list[str]:
    """Call every installed `rankcast.worker_plugins` entry point with the worker."""
    loaded = []
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            plugin = entry.load()
        except Exception as exc:
            raise ExtensionError(
                f"worker plugin {entry.name!r} ({entry.value}) failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        try:
            plugin(worker)
        except Exception as exc:
            raise ExtensionError(
                f"worker plugin {entry.name!r} failed in rank {worker.rank}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        loaded.append(entry.name)
    if loaded:
        logger.info("worker plugins loaded: %s", ", ".join(loaded))
    return loaded
