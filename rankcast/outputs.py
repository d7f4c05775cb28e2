"""What callers of the offline `LLM` and the serving layer receive for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    """The generated text so far; `delta_*` hold what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # The logprobs of `delta_token_ids` alone. `logprobs` is the request's list, which later
    # outputs extend: a stream that reads an earlier output after a later one arrived must not
    # slice it.
    delta_logprobs: list[dict[int, Logprob]] | None = None


class RequestRejectedError(ValueError):
    """The engine refused or ended a request (e.g. its adapter could not be loaded); the
    message says why. The serving layer answers it with a 400."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Why the engine refused or ended the request (finish_reason "abort"); None otherwise.
    error: str | None = None
    # With `SamplingParams.prompt_logprobs`: per prompt position, the prompt token's logprob,
    # rank and decoded text with the top-k there (the dict shape of `CompletionOutput.logprobs`);
    # None at position 0, which nothing before it predicts. In every output from the first on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
