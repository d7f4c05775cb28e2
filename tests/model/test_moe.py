"""Mixtures of experts against transformers, float32: Qwen3-MoE (Qwen3's attention; a router's
top-2 of 8 experts, renormalised; one layer left dense by `mlp_only_layers`) and Mixtral
(Mistral's attention; top-2 of 4). From HF directories; offline whole, chunked and with
prefix-cache hits (the batch-invariance rule: a token's experts' outputs are summed in one order
whatever else is in the batch), and Qwen3-MoE served at TP=2 (every rank a slice of every
expert)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rankcast.errors import ModelFormatError
from rankcast.model.loader import load_model
from rankcast.model.moe import SparseMoeBlock
from rankcast.model_files.arch import ArchConfig
from tests.model.family_models import (
    NEW_TOKENS,
    PROMPTS,
    assert_greedy_whole_chunked_and_cached,
    assert_logits_match_transformers,
    assert_served_at_tp2,
    reference_greedy_all,
    stack_and_modules_logits,
    stack_expected,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe"),
        "qwen3_moe",
        tokenizer_source,
        seed=11,
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("mixtral"),
        "mixtral",
        tokenizer_source,
        seed=12,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
    )


@pytest.fixture(scope="module")
def qwen3_moe_reference(qwen3_moe_dir: Path) -> list[list[int]]:
    return reference_greedy_all(qwen3_moe_dir, PROMPTS, NEW_TOKENS)


def test_configs_name_the_experts_and_the_dense_layers(
    qwen3_moe_dir: Path, mixtral_dir: Path
) -> None:
    qwen = ArchConfig.from_model_dir(qwen3_moe_dir)
    assert qwen.architecture == "Qwen3MoeForCausalLM" and qwen.qk_norm
    assert qwen.moe_layers == (True, False, True)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size) == (8, 2, 32)
    assert qwen.norm_topk_prob
    mixtral = ArchConfig.from_model_dir(mixtral_dir)
    assert mixtral.architecture == "MixtralForCausalLM" and not mixtral.qk_norm
    assert mixtral.moe_layers == (True, True) and mixtral.num_experts == 4
    assert mixtral.expert_intermediate_size == 48 and mixtral.norm_topk_prob
    model = load_model(qwen3_moe_dir, qwen, torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.decoder_layers()]
    assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"]
    assert not model.fuse_layers()  # the C++ stack runs dense MLPs only


def test_bad_expert_fields_are_refused_naming_them(qwen3_moe_dir: Path) -> None:
    config = json.loads((qwen3_moe_dir / "config.json").read_text())
    for change, named in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ):
        with pytest.raises(ModelFormatError, match=named):
            ArchConfig.from_dict({**config, **change})


@pytest.mark.parametrize("name", ["qwen3_moe_dir", "mixtral_dir"])
def test_logits_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    """Through the C++ decoder stack where this machine builds it, MoE layers and all."""
    assert_logits_match_transformers(request.getfixturevalue(name), fused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_gives_the_modules_bits(qwen3_moe_dir: Path, dtype: torch.dtype) -> None:
    """A decode step through the C++ decoder stack (MoE layers by csrc/moe.cpp inside it) and
    through the modules: the same logits, bit for bit."""
    if not stack_expected(dtype):
        pytest.skip("no C++ decoder stack for this dtype on this machine")
    fused, modules = stack_and_modules_logits(qwen3_moe_dir, dtype)
    torch.testing.assert_close(fused, modules, rtol=0, atol=0)


def test_greedy_whole_chunked_and_cached(
    qwen3_moe_dir: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    assert_greedy_whole_chunked_and_cached(qwen3_moe_dir, qwen3_moe_reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_who_shares_its_experts(
    qwen3_moe_dir: Path, dtype: torch.dtype
) -> None:
    """The block on one token alone, and on it among others that choose the same experts and
    others: the same bits, on the kernels this CPU runs the dtype on."""
    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    model = load_model(qwen3_moe_dir, arch, dtype, torch.device("cpu"))
    block = model.decoder_layers()[0].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.manual_seed(0)
    tokens = torch.randn(33, arch.hidden_size).to(dtype)
    together = block(tokens)
    for i in (0, 7, 32):
        torch.testing.assert_close(block(tokens[i : i + 1]), together[i : i + 1], rtol=0, atol=0)
    chosen, _ = block.route(tokens)
    assert len(torch.unique(chosen)) > 2  # the batch spreads over several experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_block_gives_the_loops_bits_and_counts(
    qwen3_moe_dir: Path, dtype: torch.dtype
) -> None:
    """csrc/moe.cpp's block (routing, the experts, the weighted sum in one call) against the
    Python loop it replaces, on one token and on a batch: the same output bits and the same
    counts per expert."""
    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    model = load_model(qwen3_moe_dir, arch, dtype, torch.device("cpu"))
    block = model.decoder_layers()[0].mlp
    assert isinstance(block, SparseMoeBlock)
    if not block.fuse():
        pytest.skip("the kernels do not run this dtype's packed experts on this machine")
    torch.manual_seed(1)
    for rows in (1, 5, 40):  # 40: past ROWS_SPLIT, where a `rows` path takes oneDNN's tiles
        tokens = torch.randn(rows, arch.hidden_size).to(dtype)
        fused_out, fused_counts = block(tokens), block.take_routed()
        fused, block.fused = block.fused, None
        loop_out, loop_counts = block(tokens), block.take_routed()
        block.fused = fused
        torch.testing.assert_close(fused_out, loop_out, rtol=0, atol=0)
        assert fused_counts is not None and loop_counts is not None
        assert fused_counts.tolist() == loop_counts.tolist()
        assert int(fused_counts.sum()) == rows * arch.experts_per_token
    assert block.take_routed() is None  # taken: none since


def test_served_at_tp2(
    qwen3_moe_dir: Path, tokenizer_source: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    """Served by a Python and a Rust API server, the same greedy tokens as transformers; and
    then each rank's expert load, through the channel, on both servers alike."""
    assert_served_at_tp2(
        qwen3_moe_dir, tokenizer_source, qwen3_moe_reference, then=_expert_load_on_every_server
    )


def _expert_load_on_every_server(server: Any) -> None:
    """`rankcast:moe_expert_tokens_total` after the requests: the same lines on the Python and
    the Rust API server, a series per (rank, MoE layer, expert) of both ranks, and each (rank,
    layer) adding up to every token the engine ran x top-2 (prompt tokens not found in the
    prefix cache, and every generated token but each request's last); both servers' engine
    views (what the page's heat map draws) carry the same tokens."""
    import httpx

    from tests.entrypoints.notification_clients import scrape_each

    family = "rankcast:moe_expert_tokens_total"
    deadline = time.monotonic() + 30
    while True:  # until the ranks' last windows (a second at most) reached both servers
        scrapes = scrape_each(server.url, 2)
        lines = {i: sorted(_samples(text, family).items()) for i, text in scrapes.items()}
        per_layer: dict[tuple[str, str], float] = {}
        for labels, value in _samples(scrapes["0"], family).items():
            where = dict(label.split("=") for label in labels.split(","))
            key = (where["rank"], where["layer"])
            per_layer[key] = per_layer.get(key, 0) + value
        want = 2 * _tokens_run(scrapes["0"])
        if (
            lines["0"] == lines["1"]
            and set(per_layer) == {(f'"{r}"', f'"{layer}"') for r in (0, 1) for layer in (0, 2)}
            and all(tokens == want for tokens in per_layer.values())
            and len(lines["0"]) == 2 * 2 * 8
        ):
            break
        assert time.monotonic() < deadline, (want, per_layer, lines)
        time.sleep(0.1)
    views = {}
    while len(views) < 2:
        assert time.monotonic() < deadline, f"engine views only from {sorted(views)}"
        reply = httpx.get(f"{server.url}/v1/engine_views", timeout=10)
        views[reply.headers["x-rankcast-api-server"]] = reply.json()["data"][0]["experts"]
    assert views["0"] == views["1"] and len(views["0"]) == 4, views


def _samples(text: str, family: str) -> dict[str, float]:
    """A family's samples in an exposition: the labels between the braces -> the value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(family + "{"):
            labels, value = line[len(family) + 1 :].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def _tokens_run(text: str) -> float:
    """Tokens the engine ran, from its and the fleet's counters: prompt tokens less those the
    prefix cache held, and each request's generated tokens but its last (never run)."""
    return sum(
        sign * value
        for sign, family in (
            (1, "vllm:prompt_tokens_total"),
            (-1, "vllm:prefix_cache_hits_total"),
            (1, "vllm:generation_tokens_total"),
            (-1, "vllm:request_success_total"),
        )
        for value in _samples(text, family).values()
    )


def test_an_adapter_on_the_experts_is_refused_naming_the_tensor(
    qwen3_moe_dir: Path, tmp_path: Path
) -> None:
    """Adapters reach the attention projections of every layer and the MLP of dense layers;
    one that adapts an expert is refused at load, naming its tensor, not served without it."""
    from safetensors.torch import save_file

    from rankcast.lora.peft_adapter import LoRAAdapterError, inspect_peft_adapter

    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    prefix = "base_model.model.model.layers"
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none"}

    def adapter(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return path

    hidden, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    attention_and_dense = adapter(
        "fine",
        {
            f"{prefix}.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, hidden),
            f"{prefix}.0.self_attn.q_proj.lora_B.weight": torch.zeros(q, 2),
            f"{prefix}.1.mlp.gate_proj.lora_A.weight": torch.zeros(2, hidden),
            f"{prefix}.1.mlp.gate_proj.lora_B.weight": torch.zeros(arch.intermediate_size, 2),
        },
    )
    assert len(inspect_peft_adapter(attention_and_dense, arch, 8).keys) == 4
    expert = f"{prefix}.0.mlp.experts.3.gate_proj.lora_A.weight"
    on_an_expert = adapter(
        "experts",
        {
            expert: torch.zeros(2, hidden),
            expert.replace("lora_A", "lora_B"): torch.zeros(arch.expert_intermediate_size, 2),
        },
    )
    with pytest.raises(LoRAAdapterError, match="mixture of experts") as refused:
        inspect_peft_adapter(on_an_expert, arch, 8)
    assert "experts.3.gate_proj" in str(refused.value)


def test_a_llama_cpp_qwen3moe_gguf_converts_and_generates_transformers_tokens(
    tmp_path: Path, tokenizer_source: Path, embedded_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file llama.cpp's converter writes of a Qwen3-MoE (every layer sparse, as llama.cpp
    makes them; the router `ffn_gate_inp` float32; each projection's experts stacked in one
    `ffn_*_exps` tensor) converts to the checkpoint's very tensors, and generates transformers'
    tokens; stored Q8_0, it is served as its own Q8_0 (`--quantization auto`), router kept
    float."""
    from rankcast import LLM, SamplingParams
    from rankcast.model.layers import ReplicatedLinear, layer_quantization
    from rankcast.model_files.gguf_convert import native_quantization
    from tests.model.family_models import (
        assert_gguf_converts_to_the_checkpoint,
        write_llama_cpp_gguf,
    )

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = write_checkpoint(
        tmp_path / "m",
        "qwen3_moe",
        tokenizer_source,
        seed=13,
        num_hidden_layers=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    gguf_path = write_llama_cpp_gguf(tmp_path / "moe.gguf", model_dir, embedded_gguf)
    converted = assert_gguf_converts_to_the_checkpoint(gguf_path, model_dir)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    want = reference_greedy_all(model_dir, PROMPTS[:1], 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(gguf_path), dtype="float32", kv_cache_space_gib=0.05) as llm:
        assert [llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids] == want

    quantized = write_llama_cpp_gguf(
        tmp_path / "moe-q8.gguf", model_dir, embedded_gguf, projections="Q8_0"
    )
    assert native_quantization(quantized) == "q8_0"
    assert layer_quantization(ReplicatedLinear(4, 2), "q8_0") == "none"
    with LLM(str(quantized), quantization="auto", kv_cache_space_gib=0.05) as llm:
        out = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    assert len(out) == 16


def test_expert_parallel_ranks_hold_whole_experts_and_answer_transformers_tokens(
    qwen3_moe_dir: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    """--enable-expert-parallel at TP=2: each rank holds 4 of the 8 experts whole (attention
    still split by heads), and the answers are transformers' tokens."""
    from rankcast import LLM, SamplingParams
    from rankcast.distributed import TensorParallelGroup

    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    shares = []
    for rank in range(2):
        block = SparseMoeBlock(arch, TensorParallelGroup(rank=rank, size=2), expert_parallel=True)
        shares.append(sorted(int(name) for name in block.experts))
        whole = block.experts[str(shares[-1][0])].gate_up_proj.weight.shape
        assert whole == (2 * arch.expert_intermediate_size, arch.hidden_size)
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(qwen3_moe_dir),
        dtype="float32",
        kv_cache_space_gib=0.05,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        worker_extension_cls=f"{__name__}:ExpertsHeld",
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        held = llm.collective_rpc("experts_held")
        hits = llm.engine.client.core.scheduler.stats().prefix_cache_hits
        ran = sum(len(p) for p in PROMPTS) - hits + len(PROMPTS) * (NEW_TOKENS - 1)
        loads = _expert_loads_until(llm, lambda by_rank: _adds_up(by_rank, 2 * ran))
    assert got == qwen3_moe_reference
    # Each rank's MoE layers (0 and 2) hold its share, and count only its share's tokens.
    assert held == [[[0, 1, 2, 3]] * 2, [[4, 5, 6, 7]] * 2]
    for layer in (0, 2):
        assert not any(loads[0][layer][4:]) and not any(loads[1][layer][:4]), loads


def _expert_loads_until(llm: Any, done: Any) -> dict[int, dict[int, list[int]]]:
    """The offline engine's expert-load events added up by rank and layer, taken until `done`
    holds of them (a rank's last window arrives within its second)."""
    from rankcast.channel.events import CustomNotification
    from rankcast.channel.expert_load import EXPERT_LOAD_KEY, read_expert_load
    from rankcast.channel.view import add_counts

    by_rank: dict[int, dict[int, list[int]]] = {}
    deadline = time.monotonic() + 30
    while not done(by_rank):
        assert time.monotonic() < deadline, by_rank
        for n in llm.take_notifications():
            if isinstance(n, CustomNotification) and n.key == EXPERT_LOAD_KEY:
                for layer, tokens in read_expert_load(n.payload) or ():
                    add_counts(by_rank.setdefault(n.rank, {}).setdefault(layer, []), tokens)
        time.sleep(0.05)
    return by_rank


def _adds_up(by_rank: dict[int, dict[int, list[int]]], want: int) -> bool:
    """Whether both ranks reported layers 0 and 2, whose counts add up to `want` a layer."""
    layers = [set(by_rank.get(rank, {})) for rank in (0, 1)]
    return layers == [{0, 2}] * 2 and all(
        sum(by_rank[0][layer]) + sum(by_rank[1][layer]) == want for layer in (0, 2)
    )


class ExpertsHeld:
    """Mixed into each rank: the experts its MoE layers hold."""

    runner: Any

    def experts_held(self) -> list[list[int]]:
        return [
            sorted(int(name) for name in layer.mlp.experts)
            for layer in self.runner.model.decoder_layers()
            if isinstance(layer.mlp, SparseMoeBlock)
        ]


# ---- expert load: what each rank counts and publishes (rankcast/worker/expert_load.py) ----


class _Steps:
    """Our model in a runner on two sequences: the first `step()` is their prompts' prefill,
    each later one a greedy decode step of both."""

    def __init__(self, model_dir: Path) -> None:
        from rankcast.worker.model_runner import ModelRunner

        arch = ArchConfig.from_model_dir(model_dir)
        self.model = load_model(model_dir, arch, torch.float32, torch.device("cpu"))
        self.runner = ModelRunner(self.model, arch, 8, torch.device("cpu"), torch.float32)
        self.runner.initialize_cache(64)
        self.blocks = [[9, 2, 30, 4, 17, 50], [0, 11]]
        self.sequences = [list(PROMPTS[0]), list(PROMPTS[2])]
        self.steps = 0

    def step(self) -> None:
        from rankcast.protocol import ScheduledSequence, SchedulerOutput

        batch = SchedulerOutput(
            [
                ScheduledSequence("r", s, 0, t)
                if self.steps == 0
                else ScheduledSequence("r", s[-1:], len(s) - 1, t)
                for s, t in zip(self.sequences, self.blocks, strict=True)
            ]
        )
        logits = self.runner.compute_logits(batch)
        for seq, row in zip(self.sequences, logits, strict=True):
            seq.append(int(row.argmax()))
        self.steps += 1

    def ran(self) -> list[list[int]]:
        """The tokens each sequence ran: all but the last one decoded."""
        return [seq[:-1] for seq in self.sequences]

    def routed(self) -> dict[int, list[int]]:
        """Each MoE layer's counts, taken (they start again from none)."""
        out = {}
        for index, layer in enumerate(self.model.decoder_layers()):
            if isinstance(layer.mlp, SparseMoeBlock):
                counts = layer.mlp.take_routed()
                assert counts is not None, f"layer {index} counted nothing"
                out[index] = counts.tolist()
        return out


def _transformers_routing(model_dir: Path, sequences: list[list[int]]) -> dict[int, list[int]]:
    """Tokens per expert of each MoE layer as transformers' own routers choose them, each
    sequence run whole."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    counts: dict[int, torch.Tensor] = {}

    def record(layer: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            chosen = output[2].flatten()  # the router returns (logits, weights, experts)
            found = torch.bincount(chosen, minlength=model.config.num_experts)
            counts[layer] = counts.get(layer, torch.zeros_like(found)) + found

        return hook

    for index, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if router is not None and hasattr(router, "top_k"):  # a dense layer's gate is a linear
            router.register_forward_hook(record(index))
    with torch.no_grad():
        for seq in sequences:
            model(torch.tensor([seq]))
    return {layer: found.tolist() for layer, found in sorted(counts.items())}


def test_each_moe_layer_counts_the_tokens_transformers_routes_to_each_expert(
    qwen3_moe_dir: Path,
) -> None:
    """A prefill and three decode steps of two sequences: each MoE layer's counts are what
    transformers' routers choose for the same tokens, expert by expert (a row sums to the
    tokens run x top-k); the dense layer counts nothing; a take starts the counts again."""
    run = _Steps(qwen3_moe_dir)
    for _ in range(4):
        run.step()
    ours = run.routed()
    assert list(ours) == [0, 2]  # layer 1 is dense (mlp_only_layers)
    assert ours == _transformers_routing(qwen3_moe_dir, run.ran())
    tokens = sum(len(seq) for seq in run.ran())
    assert all(sum(row) == 2 * tokens for row in ours.values())
    run.step()
    assert all(sum(row) == 2 * 2 for row in run.routed().values()), "one token per sequence"


def test_a_rank_publishes_the_windows_sum_once_the_window_is_due(qwen3_moe_dir: Path) -> None:
    """Steps inside one window publish nothing; the step that ends past it publishes the sum of
    all of them, per MoE layer, as one `rankcast.expert_load` event through the rank's buffer
    (validated there), and the next window starts from none."""
    from rankcast.channel.buffer import NotificationBuffer
    from rankcast.channel.events import CustomNotification
    from rankcast.channel.expert_load import EXPERT_LOAD_KEY, read_expert_load
    from rankcast.worker.expert_load import ExpertLoadWindow

    run, reference = _Steps(qwen3_moe_dir), _Steps(qwen3_moe_dir)
    now = [0.0]
    buffer = NotificationBuffer(16)
    # A 10 s window on a clock the test moves: its timer never fires while the test runs.
    window = ExpertLoadWindow.for_model(run.model, buffer.publish, 10.0, lambda: now[0])
    assert window is not None
    try:
        for at in (0.0, 4.0, 8.0, 12.0, 13.0):
            now[0] = at
            with window.step():
                run.step()
            reference.step()
            if at == 8.0:
                assert buffer.take() is None, "published inside the window"
            if at == 12.0:
                summed = reference.routed()  # the four steps of the window, not the fifth
        (published,) = buffer.take() or []
        assert isinstance(published, CustomNotification)
        assert published.key == EXPERT_LOAD_KEY and published.seq == 1
        assert published.payload["steps"] == 4 and published.payload["seconds"] == 12.0
        assert dict(read_expert_load(published.payload) or []) == summed
        assert window.steps == 1 and window.opened == 13.0
    finally:
        window.close()


def test_a_windows_tail_is_published_when_no_step_comes_to_end_it(qwen3_moe_dir: Path) -> None:
    """One step, and then none: its window's timer (50 ms) publishes it. The window's clock
    stands still, so the step itself never finds the window due, however long it takes."""
    from rankcast.channel.buffer import NotificationBuffer
    from rankcast.channel.expert_load import read_expert_load
    from rankcast.worker.expert_load import ExpertLoadWindow

    run = _Steps(qwen3_moe_dir)
    buffer = NotificationBuffer(16)
    window = ExpertLoadWindow.for_model(run.model, buffer.publish, 0.05, lambda: 0.0)
    assert window is not None
    try:
        with window.step():
            run.step()
        deadline = time.monotonic() + 10
        while not buffer.pending:
            assert time.monotonic() < deadline, "the window's tail was never published"
            time.sleep(0.01)
        (published,) = buffer.take() or []
        tokens = sum(len(seq) for seq in run.ran())
        rows = read_expert_load(published.payload)  # type: ignore[attr-defined]
        assert rows is not None and [layer for layer, _ in rows] == [0, 2]
        assert all(sum(row) == 2 * tokens for _, row in rows)
        assert window.steps == 0 and window.opened is None
    finally:
        window.close()


def test_a_dense_model_has_no_window(tiny_llama_dir: Path) -> None:
    from rankcast.worker.expert_load import ExpertLoadWindow

    arch = ArchConfig.from_model_dir(tiny_llama_dir)
    model = load_model(tiny_llama_dir, arch, torch.float32, torch.device("cpu"))
    assert ExpertLoadWindow.for_model(model, lambda n: None) is None


def test_a_large_window_is_split_by_layers_and_a_bad_row_refused_at_the_producer() -> None:
    """Qwen3-30B-A3B's shape (48 layers of 128 experts) at the largest counts: every payload
    fits one notification, the layers in order; a row that is not a count per expert is
    refused where it is made, naming it."""
    import msgspec

    from rankcast.channel.events import MAX_NOTIFICATION_BYTES, CustomNotification
    from rankcast.channel.expert_load import (
        EXPERT_LOAD_KEY,
        expert_load_payloads,
        read_expert_load,
    )
    from rankcast.channel.validation import validate_notification

    layers = list(range(48))
    tokens = [[2**64 - 1 - e for e in range(128)] for _ in layers]
    payloads = expert_load_payloads(layers, tokens, 7, 1.0)
    assert len(payloads) == 2
    assert [layer for p in payloads for layer in p["layers"]] == layers
    for payload in payloads:
        size = validate_notification(CustomNotification(key=EXPERT_LOAD_KEY, payload=payload))
        assert size <= MAX_NOTIFICATION_BYTES
        assert len(msgspec.msgpack.encode(payload)) <= MAX_NOTIFICATION_BYTES
    small = expert_load_payloads([3], [[1, 0, 2]], 1, 0.5)
    assert [read_expert_load(p) for p in small] == [[(3, [1, 0, 2])]]
    with pytest.raises(ValueError, match=r"tokens\[layer 3\]"):
        expert_load_payloads([3], [[1, -1]], 1, 0.5)
    with pytest.raises(ValueError, match="2 rows for 1 layers"):
        expert_load_payloads([3], [[1], [2]], 1, 0.5)


def test_expert_parallel_ranks_count_only_their_own_experts_tokens(qwen3_moe_dir: Path) -> None:
    """With --enable-expert-parallel each rank counts the tokens of the experts it holds (another
    rank's read 0): the ranks' counts add up to the whole routing, each expert's tokens once.
    Sliced, every rank counts every expert's."""
    from rankcast.distributed import TensorParallelGroup

    arch = ArchConfig.from_model_dir(qwen3_moe_dir)
    chosen = torch.tensor([[0, 5], [5, 7], [3, 0], [1, 6]])
    whole = torch.bincount(chosen.flatten(), minlength=8).tolist()
    ranks = [TensorParallelGroup(rank=rank, size=2) for rank in range(2)]
    counts = [SparseMoeBlock(arch, tp, expert_parallel=True).count(chosen) for tp in ranks]
    assert [c.tolist() for c in counts] == [[2, 1, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 2, 1, 1]]
    assert (counts[0] + counts[1]).tolist() == whole
    assert SparseMoeBlock(arch, ranks[1]).count(chosen).tolist() == whole


def test_pipeline_stages_split_dense_and_expert_layers(
    qwen3_moe_dir: Path, qwen3_moe_reference: list[list[int]]
) -> None:
    """PP=2 as for dense models: the first stage holds layers 0-1 (experts, then the dense
    layer), the second layer 2 (experts); transformers' tokens."""
    from rankcast import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(qwen3_moe_dir), dtype="float32", kv_cache_space_gib=0.05, pipeline_parallel_size=2
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert got == qwen3_moe_reference
