"""Prompt lookup (vLLM's `ngram` method): the tokens that followed an earlier occurrence of the
sequence's last few tokens are its draft.

The index is built as the sequence grows, one n-gram per token, so a step's lookup costs a
dictionary probe and a short comparison, not a scan of the whole context (an 8,000-token RAG
prompt would cost milliseconds a step, per request, if scanned).
"""

from __future__ import annotations

from collections.abc import Sequence

# Earlier occurrences kept per n-gram: the most recent few, of which the longest match wins.
_OCCURRENCES = 4


class NgramIndex:
    """Where each `min_n`-gram of one sequence ended, for drafts from the sequence itself."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> positions of its last token (most recent last), each with a token after it.
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # grams ending before this position are in `ends`

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def _index_to(self, stop: int) -> None:
        """Index the grams ending at positions up to `stop` (exclusive)."""
        n = self.min_n
        for end in range(max(self.indexed, n - 1), stop):
            key = tuple(self.tokens[end - n + 1 : end + 1])
            seen = self.ends.setdefault(key, [])
            seen.append(end)
            if len(seen) > _OCCURRENCES:
                del seen[0]
        self.indexed = max(self.indexed, stop)

    def match(self) -> tuple[int, int]:
        """(position after the best earlier occurrence of the sequence's suffix, its length):
        the longest of `min_n`..`max_n` tokens, the most recent among equals; (0, 0) if none."""
        tokens = self.tokens
        last = len(tokens) - 1
        if last < self.min_n:
            return 0, 0
        self._index_to(last)  # every gram with a token after it
        seen = self.ends.get(tuple(tokens[last - self.min_n + 1 :]))
        if not seen:
            return 0, 0
        best_end, best_length = -1, 0
        for end in reversed(seen):
            length = self.min_n
            while (
                length < self.max_n
                and end - length >= 0
                and tokens[end - length] == tokens[last - length]
            ):
                length += 1
            if length > best_length:
                best_end, best_length = end, length
        return best_end + 1, best_length

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the best earlier occurrence of the suffix."""
        start, length = self.match()
        if not length:
            return []
        return self.tokens[start : start + limit]
