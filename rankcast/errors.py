"""Errors a client causes, each with the kind that travels back with it.

An engine utility that raises one of these answers with its message and kind (`ErrorKind` in
`protocol.py`); the API server picks the HTTP status from the kind, never from the text. Any
other exception inside a utility is the engine's own bug: logged with its traceback and
answered as `internal`.
"""

from __future__ import annotations

from rankcast.protocol import ErrorKind


class ClientError(ValueError):
    """The caller asked for something the engine will not do; `kind` says what sort."""

    kind = ErrorKind.BAD_ARGUMENT


class UnknownAdapterError(ClientError):
    kind = ErrorKind.UNKNOWN_ADAPTER


class CapacityError(ClientError):
    """No room can be made without evicting something that must stay."""

    kind = ErrorKind.NO_CAPACITY


class AdapterBusyError(ClientError):
    kind = ErrorKind.ADAPTER_BUSY


class AdapterExistsError(ClientError):
    """The name is taken by an adapter from another path (the same path again is a no-op)."""

    kind = ErrorKind.ADAPTER_EXISTS


class UnknownMethodError(ClientError):
    kind = ErrorKind.UNKNOWN_METHOD


class ExtensionCallError(ClientError):
    """A worker-extension method the client called failed on a rank (its message says why)."""

    kind = ErrorKind.EXTENSION_FAILED


class ModelFormatError(ValueError):
    """A model file is missing, damaged or unsupported; the message names the file."""
