"""Prompt logprobs on the output rank (rankcast/worker/prompt_logprobs.py), on a tiny random
float32 model: each prompt token's score is transformers' log-softmax at the position before it,
its rank and top-k are right, and the scores are bitwise the same whole, in chunks of any size,
beside other sequences, and as a decode's sampled logprobs at that position."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from rankcast.model.linear_kernels import choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput, TokenLogprobs
from rankcast.sampling_params import SamplingParams
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model

CPU = torch.device("cpu")
VOCAB = 256
BLOCK = 4
TOP = 3
PROMPT = [random.Random(1).randrange(VOCAB) for _ in range(37)]
# Request ids never repeat on the module's one runner: it keeps a request's parameters until
# told the request finished, as a rank does.
IDS = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prompt-logprobs"), vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    path = choose_linear_path(torch.float32, CPU)
    if not path.batch_invariant:
        pytest.skip(f"float32 linears run {path.describe()}")
    arch = ArchConfig.from_model_dir(model_dir)
    runner = ModelRunner(
        load_model(model_dir, arch, torch.float32, CPU), arch, BLOCK, CPU, torch.float32
    )
    runner.initialize_cache(256, commit=False)
    return runner


class Steps:
    """Drives the runner as the scheduler would: distinct request ids and block tables, each
    request forgotten by the ranks once it is done."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(runner.kv_caches[0].shape[1]))
        random.Random(7).shuffle(self.free)  # paging must not depend on adjacent blocks
        self.finished: list[str] = []

    def new(self, tokens: int) -> tuple[str, list[int]]:
        need = -(-tokens // BLOCK)
        table, self.free = self.free[:need], self.free[need:]
        return f"r{next(IDS)}", table

    def run(self, sequences: list[ScheduledSequence]):
        output = self.runner.execute_model(SchedulerOutput(sequences, self.finished))
        self.finished = []
        assert output is not None
        return output

    def score(
        self, prompt: list[int], chunk: int, others: int = 0, top: int = TOP, seed: int = 0
    ) -> list[TokenLogprobs]:
        """The prompt's scores, its prefill in chunks of `chunk` tokens, each step beside
        `others` other sequences (prompts in chunks, then decodes) placed at random."""
        rng = random.Random(seed)
        rid, table = self.new(len(prompt))
        params = SamplingParams(temperature=0.0, prompt_logprobs=top)
        side = []
        for _ in range(others):
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
            other_id, other_table = self.new(len(tokens) + 40)
            side.append([other_id, other_table, tokens, 0])
        scored: list[TokenLogprobs] = []
        done = 0
        while done < len(prompt):
            n = min(chunk, len(prompt) - done)
            end = min(done + n, len(prompt) - 1)
            target = ScheduledSequence(
                rid,
                prompt[done : done + n],
                done,
                table,
                params if done == 0 else None,
                sample=done + n == len(prompt),
                prompt_logprob_targets=prompt[done + 1 : end + 1] or None,
            )
            step = []
            for other in side:
                other_id, other_table, tokens, computed = other
                if computed >= len(tokens):
                    tokens.append(rng.randrange(VOCAB))  # a decode of a made-up token
                m = rng.randint(1, len(tokens) - computed)
                step.append(
                    ScheduledSequence(
                        other_id,
                        tokens[computed : computed + m],
                        computed,
                        other_table,
                        SamplingParams(temperature=0.0) if computed == 0 else None,
                        sample=computed + m == len(tokens),
                    )
                )
                other[3] = computed + m
            step.insert(rng.randint(0, len(step)), target)
            output = self.run(step)
            mine = [p for p in output.prompt_logprobs or () if p.request_id == rid]
            if target.prompt_logprob_targets:
                assert [p.position for p in mine] == [done + 1]
                scored += mine[0].logprobs
            else:
                assert not mine
            done += n
        self.finished = [rid, *(other[0] for other in side)]
        return scored


def _reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(dim=-1)


def test_each_prompt_token_is_scored_as_transformers_log_softmax_with_its_rank_and_top_k(
    runner: ModelRunner, model_dir: Path
) -> None:
    scored = Steps(runner).score(PROMPT, chunk=len(PROMPT))
    want = _reference(model_dir, PROMPT)
    assert [s.token_id for s in scored] == PROMPT[1:], "one score per prompt token but the first"
    for position, s in enumerate(scored, start=1):
        row = want[position - 1]  # the logits before the token predict it
        assert s.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        assert s.rank == int((row > row[PROMPT[position]]).sum()) + 1
        top = row.topk(TOP)
        assert s.top_token_ids == top.indices.tolist(), f"top-k at position {position}"
        torch.testing.assert_close(torch.tensor(s.top_logprobs), top.values, atol=1e-4, rtol=0)
        assert s.top_logprobs == sorted(s.top_logprobs, reverse=True)
        if s.token_id in s.top_token_ids:
            assert s.rank == s.top_token_ids.index(s.token_id) + 1


@pytest.mark.parametrize("chunk", [1, 3, 8, 36])
def test_a_chunked_prompt_is_scored_bitwise_as_the_whole(runner: ModelRunner, chunk: int) -> None:
    steps = Steps(runner)
    assert steps.score(PROMPT, chunk) == steps.score(PROMPT, len(PROMPT))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_other_sequences_in_the_batch_change_no_score(runner: ModelRunner, seed: int) -> None:
    steps = Steps(runner)
    alone = steps.score(PROMPT, len(PROMPT))
    assert steps.score(PROMPT, 5 + seed, others=3, seed=seed) == alone
    assert steps.score(PROMPT, len(PROMPT), others=2, seed=seed) == alone


def test_a_prompt_row_is_the_decode_at_that_position(runner: ModelRunner) -> None:
    """A decode with logprobs at position p (its prompt: the first p + 1 tokens) sees the same
    distribution as the prompt row at p: its top-k is the scored prompt's, bit for bit."""
    steps = Steps(runner)
    scored = steps.score(PROMPT, len(PROMPT))
    for p in (0, 5, 17, len(PROMPT) - 2):
        rid, table = steps.new(p + 2)
        params = SamplingParams(temperature=0.0, logprobs=TOP)
        output = steps.run([ScheduledSequence(rid, PROMPT[: p + 1], 0, table, params)])
        assert output.logprobs is not None and output.logprobs[0] is not None
        (sampled,) = output.logprobs[0]
        assert sampled.top_token_ids == scored[p].top_token_ids
        assert sampled.top_logprobs == scored[p].top_logprobs, f"position {p}"
        steps.finished = [rid]


def test_top_0_scores_the_prompt_tokens_alone_and_only_askers_get_rows(
    runner: ModelRunner,
) -> None:
    steps = Steps(runner)
    scored = steps.score(PROMPT, 10, top=0)
    assert all(s.top_token_ids == [] and s.top_logprobs == [] for s in scored)
    assert [s.logprob for s in scored] == [s.logprob for s in steps.score(PROMPT, 10)]
    # A step where nobody asks scores nothing.
    rid, table = steps.new(len(PROMPT))
    output = steps.run([ScheduledSequence(rid, PROMPT, 0, table, SamplingParams())])
    assert output.prompt_logprobs is None
