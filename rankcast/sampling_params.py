"""Per-request generation settings; a msgspec struct because it crosses process boundaries."""

from __future__ import annotations

import msgspec

from rankcast.structured_outputs import StructuredOutputs

# The most alternatives one position may ask for, sampled (`logprobs`) or in the prompt
# (`prompt_logprobs`): vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick each next token and when to stop.

    `temperature=0` is greedy. `top_k <= 0` disables top-k. `seed` makes one request's random
    choices reproducible whatever else shares its batch. `logprobs=k` returns the k most likely
    tokens' log-probabilities (from the raw model distribution) with each sampled token.
    `structured` constrains the output to a shape (a JSON schema, a regex, ...): the output rank
    masks every token that would leave it, and the output ends (EOS) where the shape does.
    `prompt_logprobs=k` (vLLM's meaning) scores the prompt itself: for every prompt position
    after the first, the log-probability of the prompt's own token given the tokens before it,
    with its rank and the k most likely tokens there (position 0 has none). Such a request
    takes no prefix-cache hits until its prompt is scored (docs/architecture.md).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    structured: StructuredOutputs | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        """Reject out-of-range values with messages that name the field."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.n != 1:
            raise ValueError(f"only n=1 is supported, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.structured is not None and self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured outputs: the output ends where "
                "its shape does"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
