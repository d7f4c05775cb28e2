"""Token masks for structured outputs, on the rank that samples.

Each structured request gets an llguidance matcher when it first samples here; every step the
matchers of the step's structured rows write one bitmask row each (bit `t` set: token `t` keeps
the output inside its shape), the sampler sends the others to -inf on those rows only, and the
sampled tokens advance the matchers. Unconstrained rows are never touched, so a structured
request costs its batch neighbours nothing. Where the shape ends, the matcher allows only EOS,
and the engine's ordinary EOS rule finishes the request.

The matcher's state lives as long as the request's state on this rank (`ModelRunner`): a
preempted request keeps it, since it resumes with the same output so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rankcast.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# Row `v`: the 8 bits of byte value `v`, least significant first (the bitmask's bit order).
_BYTE_BITS = torch.tensor([[(v >> bit) & 1 for bit in range(8)] for v in range(256)]).bool()


@dataclass
class TokenMask:
    """Which tokens the structured rows of one step may sample."""

    rows: list[int]  # rows of the step's logits that are constrained
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], one row per constrained row

    def apply(self, logits: torch.Tensor) -> None:
        """Set every disallowed token's logit to -inf, in place, on the constrained rows only."""
        vocab = logits.shape[1]
        allowed = _BYTE_BITS[self.bitmask.view(torch.uint8).long()].view(len(self.rows), -1)
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the extra ids never fit
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed = allowed[:, :vocab].to(logits.device)
        rows = torch.tensor(self.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarMatchers:
    """The output rank's grammar machinery: one llguidance tokenizer (built on first use, as
    only structured requests need it and it takes ~0.3 s) and a matcher per structured request.
    """

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            from rankcast.tokenizer import load_tokenizer

            hf = load_tokenizer(self.tokenizer_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf,
                n_vocab=max(self.vocab_size, len(hf)),
                # The engine stops on the model's EOS ids: the grammar's end must be one of them.
                eos_token=list(self.eos_token_ids) or None,
            )
        return self._tokenizer

    def matcher(self, request_id: str, structured: StructuredOutputs) -> Any:
        """A fresh matcher for one request. A grammar llguidance refuses here (the frontend
        checked it, so only a version skew could do it) leaves the matcher in its error state,
        where it allows only EOS: that request ends, the engine and its batch go on."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), structured.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            logger.error("request %s: grammar refused: %s", request_id, matcher.get_error())
        return matcher

    def mask(self, rows: list[int], matchers: list[Any]) -> TokenMask:
        """The bitmask of the given rows' matchers, each written straight into its row."""
        words = (self._ll_tokenizer().vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        row_bytes = words * 4
        base = bitmask.data_ptr()
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        return TokenMask(rows, bitmask)

    @staticmethod
    def advance(request_id: str, matcher: Any, token: int) -> None:
        """Feed the sampled token; one the mask allowed always fits, so a refusal is a bug
        worth a log line (the matcher then allows only EOS)."""
        if not matcher.is_stopped() and not matcher.consume_token(token):
            logger.error(
                "request %s: token %d left its grammar: %s", request_id, token, matcher.get_error()
            )
