"""Token selection for a batch whose requests each have their own sampling parameters.

Random choices use the exponential-race trick (argmax of p / Exp(1) samples a token with
probability p), drawing each seeded request's noise from its own generator, so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from rankcast.model import ops
from rankcast.protocol import TokenLogprobs
from rankcast.sampling_params import SamplingParams
from rankcast.worker.grammar import TokenMask


def _filter_sorted(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p by masking logits to -inf, working on a sorted copy."""
    vocab = logits.shape[-1]
    device = logits.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    values, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    values.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    remove = (probs.cumsum(dim=-1) - probs) > top_p.unsqueeze(1)
    remove |= probs < min_p.unsqueeze(1) * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    values.masked_fill_(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, values)


def _logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    results: list[TokenLogprobs | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            results.append(None)
            continue
        token = int(tokens[row])
        lp = logprobs[row]
        chosen = lp[token]
        rank = int((lp > chosen).sum()) + 1
        top_ids: list[int] = []
        top_lps: list[float] = []
        if p.logprobs > 0:
            top = lp.topk(p.logprobs)
            top_ids = top.indices.tolist()
            top_lps = top.values.tolist()
        results.append(TokenLogprobs(token, float(chosen), rank, top_ids, top_lps))
    return results


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: TokenMask | None = None,
) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """Pick one token per row of `logits` [batch, vocab]; logprobs come from the raw model,
    before `allowed` (structured outputs) masks the constrained rows."""
    wants_logprobs = any(p.logprobs is not None for p in params)
    if not wants_logprobs and all(p.greedy for p in params):
        # The common greedy step: one pass over the logits in their own dtype, no copies.
        if allowed is not None:
            allowed.apply(logits)
        return ops.argmax(logits).tolist(), None
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
    if allowed is not None:
        allowed.apply(logits)
    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        tokens = greedy_tokens
    else:
        temps = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params], device=logits.device
        )
        scaled = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = _filter_sorted(scaled, params)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [row for row, gen in enumerate(generators) if gen is None]
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_()
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(greedy_mask, greedy_tokens, sampled)
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return token_list, None
    return token_list, _logprobs(raw_logprobs, tokens, params)
