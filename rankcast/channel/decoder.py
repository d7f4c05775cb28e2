"""How a frontend reads the notifications in an engine message: one by one, so a type this
process does not know is counted and skipped instead of spoiling the batch."""

from __future__ import annotations

import msgspec

from rankcast.channel.events import AnyNotification, Notification


class _TypeOnly(msgspec.Struct):
    """Just the tag, to name a notification type this process does not know."""

    type: str = "?"


class NotificationDecoder:
    """Decodes notifications one by one, so one unknown type never spoils a batch."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(AnyNotification)
        self._tag_decoder = msgspec.msgpack.Decoder(_TypeOnly)

    def decode(self, raws: list[msgspec.Raw]) -> tuple[list[Notification], list[str]]:
        """The notifications this process knows, and the type names of those it skipped."""
        known: list[Notification] = []
        unknown: list[str] = []
        for raw in raws:
            try:
                known.append(self._decoder.decode(raw))
            except msgspec.DecodeError:  # includes ValidationError: an unknown tag
                try:
                    unknown.append(self._tag_decoder.decode(raw).type)
                except msgspec.DecodeError:
                    unknown.append("?")
        return known, unknown
