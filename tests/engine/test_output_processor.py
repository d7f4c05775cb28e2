"""Frontend-side output processing: each output's logprobs stay its own tokens' logprobs."""

from __future__ import annotations

from pathlib import Path

from rankcast.engine_client.output_processor import OutputProcessor
from rankcast.protocol import EngineCoreOutput, TokenLogprobs
from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import load_tokenizer


def _step(token: int) -> EngineCoreOutput:
    lp = TokenLogprobs(
        token, -0.25, 1, top_token_ids=[token, token + 1], top_logprobs=[-0.25, -2.0]
    )
    return EngineCoreOutput("r", [token], new_logprobs=[lp])


def test_an_earlier_output_read_after_a_later_one_keeps_its_own_logprobs(
    embedded_model_dir: Path,
) -> None:
    """A stream that falls behind reads an output after later ones were processed (a fast
    engine, a slow client): the logprobs it renders must be that output's tokens', not the
    request's latest (the Python server once answered such a stream with a KeyError)."""
    processor = OutputProcessor(load_tokenizer(embedded_model_dir))
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=8, logprobs=2))
    first = processor.process_outputs([_step(100)]).request_outputs[0].outputs[0]
    second = processor.process_outputs([_step(200)]).request_outputs[0].outputs[0]
    assert first.delta_token_ids == [100] and second.delta_token_ids == [200]
    assert first.delta_logprobs is not None and second.delta_logprobs is not None
    assert [set(entry) for entry in first.delta_logprobs] == [{100, 101}]
    assert [set(entry) for entry in second.delta_logprobs] == [{200, 201}]
    assert second.logprobs is not None and len(second.logprobs) == 2
