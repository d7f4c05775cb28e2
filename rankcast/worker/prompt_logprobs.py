"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the output rank scores prompt tokens.

A prompt row's logits are those a decode at that position would get (the step's linears and
attention are batch-invariant: docs/cpu-paths.md), so a prompt is scored the same whole, in
chunks of any size, or beside any other sequences. Only sequences that ask get these rows: the
scheduler names the tokens to score (`ScheduledSequence.prompt_logprob_targets`), the runner
adds their rows to the step's logits, and this module turns them into `TokenLogprobs`, computed
as a sampled token's logprobs are (`sampler.py`): float32 log-softmax of the raw logits, the
token's rank among them (1 = the likeliest) and the top k.
"""

from __future__ import annotations

import torch

from rankcast.protocol import PromptLogprobs, ScheduledSequence, TokenLogprobs

# Rows scored at once: bounds the float32 copy of the logits (rows x vocabulary) a long prompt
# chunk would otherwise make in one piece (2048 rows of a 49k vocabulary: ~400 MB).
_ROWS_AT_ONCE = 256


def score_rows(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
    """Each row of `logits` [rows, vocab] scoring its target token, with the `top` likeliest."""
    scored: list[TokenLogprobs] = []
    for first in range(0, len(targets), _ROWS_AT_ONCE):
        part = targets[first : first + _ROWS_AT_ONCE]
        logprobs = logits[first : first + len(part)].float().log_softmax(dim=-1)
        tokens = torch.tensor(part, dtype=torch.long, device=logprobs.device)
        chosen = logprobs.gather(1, tokens.unsqueeze(1))
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in part]
        top_lps: list[list[float]] = [[] for _ in part]
        if top > 0:
            best = logprobs.topk(top, dim=-1)
            top_ids, top_lps = best.indices.tolist(), best.values.tolist()
        scored.extend(
            TokenLogprobs(token, logprob, rank, ids, lps)
            for token, logprob, rank, ids, lps in zip(
                part, chosen.squeeze(1).tolist(), ranks, top_ids, top_lps, strict=True
            )
        )
    return scored


def score_prompts(
    sequences: list[ScheduledSequence], logits: torch.Tensor, tops: list[int]
) -> list[PromptLogprobs]:
    """The step's prompt scores: `logits` holds the rows of each sequence that names targets,
    in batch order, and `tops` each such sequence's top-k count."""
    scored: list[PromptLogprobs] = []
    row = 0
    asking = [seq for seq in sequences if seq.prompt_logprob_targets]
    for seq, top in zip(asking, tops, strict=True):
        targets = seq.prompt_logprob_targets
        assert targets is not None
        rows = logits[row : row + len(targets)]
        row += len(targets)
        scored.append(
            PromptLogprobs(seq.request_id, seq.start_position + 1, score_rows(rows, targets, top))
        )
    return scored
