"""Frontend-side processing of engine outputs: text, stop strings, logprobs, finished states.

It runs where the caller is (the offline `LLM`'s process or an API server), keeping
detokenization off the engine core's busy loop. A stop string found here finishes the request
and tells the caller which engine requests to abort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rankcast.engine_client.detokenizer import IncrementalDetokenizer
from rankcast.outputs import CompletionOutput, Logprob, RequestOutput
from rankcast.protocol import EngineCoreOutput, FinishReason, TokenLogprobs
from rankcast.sampling_params import SamplingParams
from rankcast.tokenizer import ModelTokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    # The scored prompt (`params.prompt_logprobs`) once the engine sent it (first output).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    requests_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def _logprob_entry(self, state: RequestState, item: TokenLogprobs) -> dict[int, Logprob]:
        detok = state.detokenizer
        entry = {
            tid: Logprob(lp, rank + 1, detok.decode_token(tid))
            for rank, (tid, lp) in enumerate(
                zip(item.top_token_ids, item.top_logprobs, strict=True)
            )
        }
        entry[item.token_id] = Logprob(item.logprob, item.rank, detok.decode_token(item.token_id))
        return entry

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue  # aborted by the caller or already finished by a stop string
            new_ids = list(output.new_token_ids)
            state.token_ids.extend(new_ids)
            delta_logprobs = None
            if state.logprobs is not None:
                delta_logprobs = [
                    self._logprob_entry(state, lp) for lp in output.new_logprobs or ()
                ]
                state.logprobs.extend(delta_logprobs)
            if output.prompt_logprobs is not None:
                # The first prompt token has no score: vLLM's None at position 0.
                state.prompt_logprobs = [None]
                state.prompt_logprobs += [
                    self._logprob_entry(state, lp) for lp in output.prompt_logprobs
                ]
            finish_reason = output.finish_reason
            stop_reason: int | str | None = output.stop_reason
            to_decode = new_ids
            if (
                finish_reason == FinishReason.STOP
                and not state.params.include_stop_str_in_output
                and new_ids
            ):
                to_decode = new_ids[:-1]  # the EOS or stop token itself is not text
            matched = state.detokenizer.update(to_decode)
            if matched is not None and finish_reason is None:
                finish_reason, stop_reason = FinishReason.STOP, matched
                to_abort.append(output.request_id)
            elif matched is not None:
                finish_reason, stop_reason = FinishReason.STOP, matched
            finished = finish_reason is not None
            delta = state.detokenizer.take_delta(finished)
            completion = CompletionOutput(
                index=0,
                text=state.detokenizer.text,
                token_ids=list(state.token_ids),
                finish_reason=str(finish_reason) if finished else None,
                stop_reason=stop_reason,
                logprobs=state.logprobs,
                delta_text=delta,
                delta_token_ids=new_ids,
                delta_logprobs=delta_logprobs,
            )
            results.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=[completion],
                    finished=finished,
                    error=output.error,
                    prompt_logprobs=state.prompt_logprobs,
                )
            )
            if finished:
                del self.states[output.request_id]
        return ProcessedOutputs(results, to_abort)
