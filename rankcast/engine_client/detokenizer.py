"""Incremental detokenization and stop-string matching for one request.

Text is produced with the tokenizers library's `DecodeStream`, which withholds a token's bytes
until they complete a UTF-8 character, so no output ever carries half a character. When stop
strings are set, the last `len(longest stop) - 1` characters are held back from streamed
deltas until it is clear they do not begin a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import ModelTokenizer

# Prompt tokens fed to the stream first, so the first generated token decodes with its context
# (leading spaces in SentencePiece vocabularies depend on what precedes them).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: ModelTokenizer, prompt_token_ids: list[int], params: SamplingParams
    ):
        self.backend: Tokenizer = tokenizer.backend
        self.stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
            skip_special_tokens=params.skip_special_tokens,
        )
        self.stops = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def update(self, token_ids: list[int]) -> str | None:
        """Decode new tokens; return the stop string that ended the text, if one did."""
        for token_id in token_ids:
            piece = self.stream.step(self.backend, token_id)
            if not piece:
                continue
            before = len(self.text)
            self.text += piece
            if self.stops:
                matched = self._match_stop(before)
                if matched is not None:
                    return matched
        return None

    def _match_stop(self, new_from: int) -> str | None:
        search_from = max(0, new_from - self.holdback)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop

    def take_delta(self, finished: bool) -> str:
        """The text not yet handed out, minus any tail that could still start a stop string."""
        end = len(self.text) if finished or not self.stops else len(self.text) - self.holdback
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def decode_token(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)
