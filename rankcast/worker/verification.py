"""Checking a sequence's drafted tokens (speculative decoding) against the model, exactly.

A sequence with drafts d1..dk comes to the step as its newest token followed by the drafts, so
the step has logits at k + 1 positions: after the newest token, after d1, ..., after dk. Each
position is sampled as a step of its own would sample it, and the sequence keeps the tokens up
to and including the first one that differs from its draft (all k + 1 when every draft holds).

Why this changes nothing a user can see: the batch-invariance rule makes the logits at each of
those positions bitwise those of single-token steps, and a token is kept only where it is the
token the model samples there given everything before it, which is the draft. Greedy output is
therefore the same token sequence with speculation on and off. A seeded request's noise comes
from its own generator one position at a time, and the generator is left as if only the kept
positions had drawn (`rewind`), so a seeded request samples the same tokens as without drafts;
an unseeded one samples each kept token from the target distribution, which is all sampling
promises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rankcast.protocol import ScheduledSequence, TokenLogprobs


@dataclass
class RowSpan:
    """One sampling sequence's rows of the step's logits: its first row and how many (1 +
    its drafts), and the drafts the rows after the first check."""

    first: int
    drafts: list[int]

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts)


def row_spans(sampling: list[ScheduledSequence]) -> list[RowSpan]:
    """The rows of each sampling sequence, in order (`ModelRunner.compute_logits` made them)."""
    spans: list[RowSpan] = []
    first = 0
    for seq in sampling:
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
        spans.append(RowSpan(first, drafts if seq.num_draft_tokens else []))
        first += spans[-1].rows
    return spans


def keep_count(sampled: list[int], drafts: list[int]) -> int:
    """How many of the rows' sampled tokens the sequence keeps: every one up to and including
    the first that differs from the draft checked at its position."""
    for position, draft in enumerate(drafts):
        if sampled[position] != draft:
            return position + 1
    return len(drafts) + 1


def generator_states(
    spans: list[RowSpan], generators: list[torch.Generator | None]
) -> list[torch.Tensor | None]:
    """Each drafting seeded sequence's generator state before the step's draws, for `rewind`."""
    return [
        gen.get_state() if gen is not None and span.drafts else None
        for span, gen in zip(spans, generators, strict=True)
    ]


def rewind(
    generator: torch.Generator, state: torch.Tensor, kept: int, vocab: int, device: torch.device
) -> None:
    """Leave `generator` as if only `kept` positions had drawn their noise: back to `state`,
    then `kept` draws of the sampler's shape (sampler.py draws one [vocab] exponential row per
    position)."""
    generator.set_state(state)
    scratch = torch.empty(vocab, device=device)
    for _ in range(kept):
        scratch.exponential_(generator=generator)


def split_rows(
    tokens: list[int],
    logprobs: list[TokenLogprobs | None] | None,
    spans: list[RowSpan],
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None, list[int]]:
    """Per sequence, the tokens it keeps and their logprobs (None where not asked for), and
    how many it kept."""
    kept_tokens: list[list[int]] = []
    kept_logprobs: list[list[TokenLogprobs] | None] = []
    counts: list[int] = []
    for span in spans:
        rows = tokens[span.first : span.first + span.rows]
        kept = keep_count(rows, span.drafts)
        counts.append(kept)
        kept_tokens.append(rows[:kept])
        if logprobs is not None:
            row_logprobs = [lp for lp in logprobs[span.first : span.first + kept] if lp is not None]
            kept_logprobs.append(row_logprobs or None)
    return kept_tokens, (kept_logprobs if logprobs is not None else None), counts
