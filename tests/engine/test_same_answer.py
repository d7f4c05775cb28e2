"""The same answer whatever else runs, through the whole offline engine in its default precision
(bfloat16 where the CPU multiplies it): chats sharing a long system prompt give the same greedy
text in one batch with the prefix cache cold, in one batch again with it warm, and each alone.
The model-level property tests (tests/model/test_batch_invariance.py) compare logits bit for bit;
this is the check a user makes."""

from __future__ import annotations

import pytest

from rankcast import LLM, SamplingParams
from rankcast.model.linear_kernels import choose_linear_path
from rankcast.platform import resolve_dtype

SYSTEM = (
    "You are a careful assistant for a library. Answer in one short paragraph, name the shelf "
    "a book is on when you know it, and never invent a title. The shelves are: A for atlases, "
    "B for biographies, C for cookery, D for drama, E for engineering, F for fiction. "
) * 4
QUESTIONS = [
    "Where would I find a book about bridges?",
    "Is there a cookbook for bread?",
    "Which shelf has plays?",
    "Do you keep maps of Europe?",
    "Where are the novels?",
    "I want the life of a famous scientist.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_chats_sharing_a_prefix_answer_the_same_cold_warm_and_alone() -> None:
    import torch

    dtype = resolve_dtype("auto", torch.device("cpu"))
    path = choose_linear_path(dtype, torch.device("cpu"))
    if not path.batch_invariant:
        pytest.skip(f"{dtype} linears run {path.describe()}")
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    with LLM(kv_cache_space_gib=0.25, max_num_seqs=8) as llm:

        def texts(batch: list[list[dict[str, str]]]) -> list[str]:
            return [out.outputs[0].text for out in llm.chat(batch, GREEDY)]

        scheduler = llm.engine.client.core.scheduler
        cold = texts(chats)
        hits_before = scheduler.stats().prefix_cache_hits
        warm = texts(chats)
        assert scheduler.stats().prefix_cache_hits > hits_before, "no prefix was reused"
        alone = [texts([chat])[0] for chat in chats[:3]]
    assert warm == cold
    assert alone == cold[:3]
