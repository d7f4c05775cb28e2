"""Suffix decoding (vLLM's `suffix` method): drafts from the request's own text and from the
outputs of recent requests, so an answer repeated across requests (a template, a boilerplate
reply, an agent's recurring tool call) speculates from its second time on.

Every earlier place where the sequence's last `SUFFIX_KEY` tokens occur is a candidate; those
matching the longest suffix (up to `suffix_decoding_max_tree_depth` tokens) vote, position by
position, for what comes next, and the draft follows the most frequent continuation while it
holds at least `suffix_decoding_min_token_prob` of the votes, for at most
`suffix_decoding_max_spec_factor` times the length matched: a long match with one consistent
continuation drafts far, a short or disputed one little or nothing. This is the frequency-
weighted walk down a suffix tree, done over an index of the places instead of the tree.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankcast.config import SpeculativeConfig
    from rankcast.engine_core.speculation.ngram import NgramIndex

# Tokens that must match before a place is a candidate at all.
SUFFIX_KEY = 3
# Places remembered per key in the cache of outputs (the most recent).
_PLACES_PER_KEY = 16
# Tokens the cache holds at most, whatever `max_requests` says: the index costs ~100 bytes a
# token in Python, so this bounds it near 50 MB.
MAX_CACHED_TOKENS = 500_000


class SuffixCache:
    """The outputs of the last `max_requests` finished requests (and no more than
    `MAX_CACHED_TOKENS` tokens of them), indexed by their keys."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.outputs: dict[int, list[int]] = {}
        self.cached_tokens = 0
        self.next_id = 0
        self.places: dict[tuple[int, ...], collections.deque[tuple[int, int]]] = {}

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_requests == 0 or len(tokens) <= SUFFIX_KEY:
            return
        output_id = self.next_id
        self.next_id += 1
        self.outputs[output_id] = list(tokens)
        self.cached_tokens += len(tokens)
        self._index(output_id, self.outputs[output_id])
        while len(self.outputs) > self.max_requests or self.cached_tokens > MAX_CACHED_TOKENS:
            oldest = next(iter(self.outputs))  # its places lapse (skipped where found)
            self.cached_tokens -= len(self.outputs.pop(oldest))
        if len(self.places) > 2 * self.cached_tokens:  # mostly lapsed keys: index afresh
            self.places = {}
            for kept_id, text in self.outputs.items():
                self._index(kept_id, text)

    def _index(self, output_id: int, tokens: list[int]) -> None:
        for end in range(SUFFIX_KEY - 1, len(tokens) - 1):
            key = tuple(tokens[end - SUFFIX_KEY + 1 : end + 1])
            places = self.places.get(key)
            if places is None:
                places = self.places[key] = collections.deque(maxlen=_PLACES_PER_KEY)
            places.append((output_id, end))

    def propose(self, own: NgramIndex, limit: int, config: SpeculativeConfig) -> list[int]:
        tokens = own.tokens
        if len(tokens) < SUFFIX_KEY:
            return []
        depth = config.suffix_decoding_max_tree_depth
        # (matched length, the text the place is in, where its continuation starts)
        candidates: list[tuple[int, list[int], int]] = []
        start, length = own.match()
        if length:
            candidates.append((length, tokens, start))
        for output_id, end in self.places.get(tuple(tokens[-SUFFIX_KEY:]), ()):
            text = self.outputs.get(output_id)
            if text is None:
                continue
            matched = SUFFIX_KEY
            while (
                matched < depth
                and end - matched >= 0
                and matched < len(tokens)
                and text[end - matched] == tokens[-1 - matched]
            ):
                matched += 1
            candidates.append((matched, text, end + 1))
        if not candidates:
            return []
        longest = max(matched for matched, _, _ in candidates)
        voters = [(text, begin) for matched, text, begin in candidates if matched == longest]
        length_cap = min(limit, int(config.suffix_decoding_max_spec_factor * longest))
        draft: list[int] = []
        while len(draft) < length_cap:
            position = len(draft)
            votes = collections.Counter(
                text[begin + position] for text, begin in voters if begin + position < len(text)
            )
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            if count / len(voters) < config.suffix_decoding_min_token_prob:
                break
            draft.append(token)
            voters = [
                (text, begin)
                for text, begin in voters
                if begin + position < len(text) and text[begin + position] == token
            ]
        return draft
