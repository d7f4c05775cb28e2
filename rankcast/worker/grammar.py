"""Token masks for structured outputs, on the rank that samples.

Each structured request gets an xgrammar matcher when it first samples here; every step the
matchers of the step's structured rows write one bitmask row each (bit `t` set: token `t` keeps
the output inside its shape), the sampler sends the others to -inf on those rows only, and the
sampled tokens advance the matchers. Unconstrained rows are never touched, so a structured
request costs its batch neighbours nothing. Where the shape ends, the matcher allows only the
model's EOS ids, and the engine's ordinary EOS rule finishes the request.

The matcher's state lives as long as the request's state on this rank (`ModelRunner`): a
preempted request keeps it, since it resumes with the same output so far.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from rankcast.model import ops
from rankcast.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept per rank, so a schema many requests share is compiled once.
COMPILED_GRAMMARS_KEPT = 64


@dataclass
class TokenMask:
    """Which tokens the structured rows of one step may sample."""

    rows: list[int]  # rows of the step's logits that are constrained
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], one row per constrained row

    def apply(self, logits: torch.Tensor) -> None:
        """Set every disallowed token's logit to -inf, in place, on the constrained rows only."""
        ops.apply_token_bitmask(logits, self.rows, self.bitmask)


class _Refused:
    """Stands in for the matcher of a grammar the rank could not compile: allows only EOS."""


class GrammarMatchers:
    """The output rank's grammar machinery: xgrammar's tokenizer info and compiler (built on
    first use: only structured requests need them) and a matcher per structured request."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler: Any = None
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()

    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            from rankcast.tokenizer import load_hf_tokenizer

            info = xgrammar.TokenizerInfo.from_huggingface(
                load_hf_tokenizer(self.tokenizer_dir),
                vocab_size=self.vocab_size,
                # The engine stops on the model's EOS ids: the grammar's end must be one of them.
                stop_token_ids=list(self.eos_token_ids) or None,
            )
            self._compiler = xgrammar.GrammarCompiler(
                info, max_threads=torch.get_num_threads(), cache_enabled=False
            )
        return self._compiler

    def matcher(self, request_id: str, structured: StructuredOutputs) -> Any:
        """A fresh matcher for one request. A grammar that fails to compile here (the frontend
        checked it, so only a version skew could do it) gets a stand-in that allows only EOS:
        that request ends, the engine and its batch go on."""
        import xgrammar

        key = msgspec.msgpack.encode(structured)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self.compiler().compile_grammar(structured.xgrammar_grammar())
            except (RuntimeError, ValueError) as exc:
                logger.error("request %s: grammar refused: %s", request_id, exc)
                return _Refused()
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return xgrammar.GrammarMatcher(compiled)

    def mask(
        self, firsts: list[int], matchers: list[Any], drafts: list[list[int]] | None = None
    ) -> TokenMask:
        """The bitmask of each matcher's rows, written straight into them (a few microseconds a
        row: no threads needed): the row at `firsts[i]`, and with drafts (speculative decoding)
        one row after each draft, for the grammar's state once it has taken the drafts before
        it. The matcher takes each draft to write the next row and is rolled back after, so
        it is left where it was; past a draft the grammar refuses, rows allow every token (the
        draft is rejected there anyway: the row before it cannot sample it)."""
        words = (self.vocab_size + 31) // 32
        drafts = drafts or [[] for _ in matchers]
        rows = [
            first + offset
            for first, draft in zip(firsts, drafts, strict=True)
            for offset in range(1 + len(draft))
        ]
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        row = 0
        for matcher, draft in zip(matchers, drafts, strict=True):
            span = 1 + len(draft)
            if isinstance(matcher, _Refused):
                bitmask[row : row + span] = 0
                for eos in self.eos_token_ids:
                    bitmask.view(torch.uint8)[row : row + span, eos // 8] |= 1 << (eos % 8)
                row += span
                continue
            matcher.fill_next_token_bitmask(bitmask, row)
            taken = 0
            for token in draft:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                taken += 1
                matcher.fill_next_token_bitmask(bitmask, row + taken)
            bitmask[row + taken + 1 : row + span] = -1  # after a draft the grammar refused
            if taken:
                matcher.rollback(taken)
            row += span
        return TokenMask(rows, bitmask)

    @staticmethod
    def advance(request_id: str, matcher: Any, token: int) -> None:
        """Feed the sampled token; one the mask allowed always fits, so a refusal is a bug
        worth a log line."""
        if isinstance(matcher, _Refused) or matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            logger.error("request %s: token %d left its grammar", request_id, token)
