"""Stored responses of `/v1/responses` (`store: true`), shared by every API server of a fleet.

A conversation continued with `previous_response_id` may reach any API server behind the port
(the kernel spreads connections), Python or Rust, so what one stored the others must read. The
launcher gives the fleet one private directory (`RANKCAST_RESPONSE_STORE`, beside the metrics
files, removed when the fleet stops); each stored response is one JSON file in it, written
whole and renamed into place so a reader never sees half of one. The store is bounded: past
`MAX_RESPONSES` files or `MAX_BYTES` bytes the oldest are removed, so a long-running fleet holds
at most that much (a conversation continued from a removed response gets a 404 naming it).
Outside a fleet (an API server started on its own) the store is this process's memory.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import msgspec

RESPONSE_STORE_ENV = "RANKCAST_RESPONSE_STORE"
MAX_RESPONSES = 1000
MAX_BYTES = 64 * 2**20

# Ids are ours (`resp_` and hex); anything else cannot name a file in the store.
_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class StoredResponse(msgspec.Struct):
    """A response as `GET /v1/responses/{id}` answers it, and the conversation it ends as chat
    messages (its input, then its output), which a continuation starts from."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, directory: str | None = None) -> None:
        given = directory if directory is not None else os.environ.get(RESPONSE_STORE_ENV)
        self.directory = Path(given) if given else None
        self._memory: dict[str, bytes] = {}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        data = msgspec.json.encode(stored)
        if self.directory is None:
            self._memory[response_id] = data
            while len(self._memory) > MAX_RESPONSES:
                del self._memory[next(iter(self._memory))]
            return
        partial = self.directory / f".{response_id}.tmp"
        partial.write_bytes(data)
        os.replace(partial, self.directory / f"{response_id}.json")
        self._bound()

    def get(self, response_id: str) -> StoredResponse | None:
        if not _ID.match(response_id):
            return None
        if self.directory is None:
            data = self._memory.get(response_id)
        else:
            try:
                data = (self.directory / f"{response_id}.json").read_bytes()
            except FileNotFoundError:
                data = None
        return None if data is None else msgspec.json.decode(data, type=StoredResponse)

    def delete(self, response_id: str) -> bool:
        if not _ID.match(response_id):
            return False
        if self.directory is None:
            return self._memory.pop(response_id, None) is not None
        try:
            (self.directory / f"{response_id}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def _bound(self) -> None:
        """Remove the oldest files until the store is within both bounds."""
        assert self.directory is not None
        files = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".json"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed by a sibling meanwhile
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        if len(files) <= MAX_RESPONSES and total <= MAX_BYTES:
            return
        files.sort()
        for count, (_, size, path) in enumerate(files):
            if len(files) - count <= MAX_RESPONSES and total <= MAX_BYTES:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
