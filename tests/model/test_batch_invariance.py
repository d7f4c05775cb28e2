"""Batch invariance: a request's logits at every position it samples are bitwise the same alone
and in any step composition (docs/cpu-paths.md, docs/speed.md "The same answer whatever else runs").

Property tests over random compositions (hypothesis): the request's prompt chunked at any size,
part of its prefix taken from blocks another batch computed (prefix caching), other sequences
beside it in mixed prefill and decode phases at any place in the batch, and LoRA requests
beside it (its own adapter fixed). Logits are compared bit for bit, not tokens. Run on the
kernel build this CPU takes by default; tests/model/test_cpu_families.py runs them again on the
builds other CPU families get.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankcast.lora.peft_adapter import load_peft_adapter
from rankcast.model.linear_kernels import choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import write_tiny_model

CPU = torch.device("cpu")
GENERATED = 3  # positions sampled after the prompt's last one


def _invariant_path_or_skip(dtype: torch.dtype) -> None:
    path = choose_linear_path(dtype, CPU)
    if not path.batch_invariant:
        pytest.skip(f"{dtype} linears run {path.describe()}")


@dataclass
class Blocks:
    """Hands out distinct cache blocks in a scattered order (paging must not depend on
    adjacency)."""

    free: list[int]

    def take(self, tokens: int, block_size: int) -> list[int]:
        need = -(-tokens // block_size)
        taken, self.free = self.free[:need], self.free[need:]
        assert len(taken) == need, "test sized the cache too small"
        return taken


@dataclass
class Other:
    """A sequence sharing the target's steps: its prompt in chunks, then decodes."""

    request_id: str
    tokens: list[int]
    blocks: list[int]
    lora_slot: int
    done: int = 0  # tokens whose K/V are cached
    rng: random.Random = field(default_factory=random.Random)
    capacity: int = 0  # tokens its blocks hold: it finishes there (a chunk-1 target runs long)

    def next_work(self) -> ScheduledSequence | None:
        if self.rng.random() < 0.25:
            return None  # not scheduled this step
        if self.done >= len(self.tokens):
            if len(self.tokens) >= self.capacity:
                return None  # finished
            self.tokens.append(self.rng.randrange(50))  # a decode of a made-up token
        remaining = len(self.tokens) - self.done
        n = remaining if remaining == 1 else self.rng.randint(1, remaining)
        seq = ScheduledSequence(
            self.request_id,
            self.tokens[self.done : self.done + n],
            self.done,
            self.blocks,
            lora_slot=self.lora_slot,
            sample=self.done + n == len(self.tokens),
        )
        self.done += n
        return seq


class Harness:
    """One runner and the target's reference logits, computed alone."""

    def __init__(self, runner: ModelRunner, vocab: int, lora_slots: int) -> None:
        self.runner = runner
        self.vocab = vocab
        self.lora_slots = lora_slots

    def blocks(self, seed: int) -> Blocks:
        ids = list(range(self.runner.kv_caches[0].shape[1]))
        random.Random(seed).shuffle(ids)
        return Blocks(ids)

    def alone(self, prompt: list[int], slot: int) -> tuple[list[int], list[torch.Tensor]]:
        """The target by itself: its whole prompt in one step, then one decode per step; the
        tokens it samples greedily and its logits at each sampled position."""
        bs = self.runner.block_size
        table = self.blocks(0).take(len(prompt) + GENERATED, bs)
        tokens, logits = list(prompt), []
        step = ScheduledSequence("t", list(prompt), 0, table, lora_slot=slot)
        for _ in range(GENERATED + 1):
            row = self._logits([step], 0)
            logits.append(row)
            tokens.append(int(row.argmax()))
            step = ScheduledSequence("t", tokens[-1:], len(tokens) - 1, table, lora_slot=slot)
        return tokens[len(prompt) :], logits

    def _logits(self, step: list[ScheduledSequence], index: int) -> torch.Tensor:
        out = self.runner.compute_logits(SchedulerOutput(step))
        assert out is not None
        sampling = [i for i, s in enumerate(step) if s.sample]
        return out[sampling.index(index)].clone()

    def composed(self, data: st.DataObject, prompt: list[int], slot: int, sampled: list[int]):
        """The target inside steps hypothesis composes; its logits at the same positions."""
        bs = self.runner.block_size
        blocks = self.blocks(data.draw(st.integers(1, 1000), label="block order"))
        rng = random.Random(data.draw(st.integers(0, 2**16), label="other sequences' phases"))
        whole = prompt + sampled
        # Prefix caching: the first `cached` blocks of the prompt computed by a donor with the
        # same prefix and adapter (the cache keys blocks by both), inside a batch of its own,
        # before the target starts.
        cached = data.draw(st.integers(0, (len(prompt) - 1) // bs), label="cached blocks")
        table = blocks.take(len(whole), bs)
        if cached:
            donor = ScheduledSequence(
                "donor", prompt[: cached * bs], 0, table[:cached], lora_slot=slot
            )
            filler = Other("f", self._random_prompt(rng), [], 0, rng=rng)
            filler.capacity = len(filler.tokens) + 8
            filler.blocks = blocks.take(filler.capacity, bs)
            self.runner.compute_logits(SchedulerOutput([donor, *self._work([filler])]))
        chunk = data.draw(st.integers(1, len(prompt)), label="chunk size")
        others = [
            Other(
                f"o{i}",
                self._random_prompt(rng),
                [],
                rng.randrange(-1, self.lora_slots),
                rng=rng,
            )
            for i in range(data.draw(st.integers(0, 4), label="other sequences"))
        ]
        for other in others:
            other.capacity = len(other.tokens) + GENERATED + 8
            other.blocks = blocks.take(other.capacity, bs)
        done, logits = cached * bs, []
        while len(logits) < GENERATED + 1:
            n = min(chunk, len(prompt) - done) if done < len(prompt) else 1
            target = ScheduledSequence(
                "t",
                whole[done : done + n],
                done,
                table,
                lora_slot=slot,
                sample=done + n >= len(prompt),
            )
            step = self._work(others)
            place = data.draw(st.integers(0, len(step)), label="target's place")
            step.insert(place, target)
            if target.sample:
                logits.append(self._logits(step, place))
            else:
                self.runner.compute_logits(SchedulerOutput(step))
            done += n
        return logits

    def verified(
        self, data: st.DataObject, prompt: list[int], slot: int, sampled: list[int]
    ) -> list[torch.Tensor]:
        """The target's decodes checked as drafts (speculative decoding): its prompt, then one
        step holding its first sampled token and the next ones as drafts, the last draft wrong
        when hypothesis says so, beside other sequences. Its rows' logits, each after a token
        that is the target's own (after a wrong draft the row is not the target's)."""
        bs = self.runner.block_size
        blocks = self.blocks(data.draw(st.integers(1, 1000), label="block order"))
        rng = random.Random(data.draw(st.integers(0, 2**16), label="other sequences' phases"))
        table = blocks.take(len(prompt) + GENERATED, bs)
        self.runner.compute_logits(
            SchedulerOutput([ScheduledSequence("t", prompt, 0, table, lora_slot=slot)])
        )
        tokens = sampled[:GENERATED]
        wrong = data.draw(st.booleans(), label="last draft wrong")
        if wrong:
            tokens[-1] = (tokens[-1] + 1) % self.vocab
        others = [
            Other(
                f"o{i}", self._random_prompt(rng), [], rng.randrange(-1, self.lora_slots), rng=rng
            )
            for i in range(data.draw(st.integers(0, 3), label="other sequences"))
        ]
        for other in others:
            other.capacity = len(other.tokens) + 8
            other.blocks = blocks.take(other.capacity, bs)
        step = self._work(others)
        place = data.draw(st.integers(0, len(step)), label="target's place")
        target = ScheduledSequence(
            "t", tokens, len(prompt), table, lora_slot=slot, num_draft_tokens=GENERATED - 1
        )
        step.insert(place, target)
        out = self.runner.compute_logits(SchedulerOutput(step))
        assert out is not None
        first = sum(1 + s.num_draft_tokens for s in step[:place] if s.sample)
        rows = GENERATED - 1 if wrong else GENERATED
        return [out[first + row].clone() for row in range(rows)]

    def _random_prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(self.vocab) for _ in range(rng.randint(1, 30))]

    @staticmethod
    def _work(others: list[Other]) -> list[ScheduledSequence]:
        return [w for w in (o.next_work() for o in others) if w is not None]


def _runner(model_dir: Path, dtype: torch.dtype, block_size: int, blocks: int) -> ModelRunner:
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, dtype, CPU)
    runner = ModelRunner(model, arch, block_size, CPU, dtype)
    runner.initialize_cache(blocks)
    return runner


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    """The tiny model with two LoRA slots holding real PEFT adapters."""
    from tests.lora.conftest import make_adapter

    dtype = request.param
    _invariant_path_or_skip(dtype)
    root = tmp_path_factory.mktemp("invariance")
    model_dir = write_tiny_model(root / "m", vocab_size=256, seed=5)
    runner = _runner(model_dir, dtype, block_size=4, blocks=512)
    runner.enable_lora(2, 8)
    for slot, rank in enumerate((4, 8)):
        make_adapter(model_dir, root / f"a{slot}", rank=rank)
        adapter = load_peft_adapter(f"a{slot}", root / f"a{slot}", runner.arch, max_lora_rank=8)
        runner.set_lora(slot, adapter)
    return Harness(runner, 256, lora_slots=2)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_tiny_models_logits_do_not_depend_on_the_batch(tiny: Harness, data: st.DataObject):
    prompt = data.draw(st.lists(st.integers(0, 255), min_size=2, max_size=40), label="prompt")
    slot = data.draw(st.integers(-1, 1), label="target's adapter slot")
    sampled, alone = tiny.alone(prompt, slot)
    composed = tiny.composed(data, prompt, slot, sampled)
    for position, (want, got) in enumerate(zip(alone, composed, strict=True)):
        assert torch.equal(want, got), f"logits differ at sampled position {position}"


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def smollm(request: pytest.FixtureRequest, embedded_model_dir: Path) -> Harness:
    dtype = request.param
    _invariant_path_or_skip(dtype)
    runner = _runner(embedded_model_dir, dtype, block_size=16, blocks=96)
    return Harness(runner, runner.arch.vocab_size, lora_slots=0)


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_smollm2s_logits_do_not_depend_on_the_batch(smollm: Harness, data: st.DataObject):
    prompt = data.draw(
        st.lists(st.integers(0, smollm.vocab - 1), min_size=17, max_size=60), label="prompt"
    )
    sampled, alone = smollm.alone(prompt, -1)
    composed = smollm.composed(data, prompt, -1, sampled)
    for position, (want, got) in enumerate(zip(alone, composed, strict=True)):
        assert torch.equal(want, got), f"logits differ at sampled position {position}"


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_verification_step_gives_each_draft_the_logits_of_its_own_decode(
    tiny: Harness, data: st.DataObject
):
    """Speculative decoding's exactness rests on this: the logits at a drafted position, inside
    a step that checks several drafts beside other sequences, are bitwise those of the decode
    that would have computed that position by itself."""
    prompt = data.draw(st.lists(st.integers(0, 255), min_size=2, max_size=40), label="prompt")
    slot = data.draw(st.integers(-1, 1), label="target's adapter slot")
    sampled, alone = tiny.alone(prompt, slot)
    verified = tiny.verified(data, prompt, slot, sampled)
    for position, got in enumerate(verified):
        assert torch.equal(alone[1 + position], got), f"logits differ at draft row {position}"


@settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_smollm2s_verification_rows_are_its_decodes(smollm: Harness, data: st.DataObject):
    prompt = data.draw(
        st.lists(st.integers(0, smollm.vocab - 1), min_size=17, max_size=60), label="prompt"
    )
    sampled, alone = smollm.alone(prompt, -1)
    verified = smollm.verified(data, prompt, -1, sampled)
    for position, got in enumerate(verified):
        assert torch.equal(alone[1 + position], got), f"logits differ at draft row {position}"
