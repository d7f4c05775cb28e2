"""The CUDA path, where torch sees a GPU (skipped everywhere else, CI included).

On CUDA every fused step of a decoder layer runs its plain-torch form (`model/ops.py`), the
linears run `F.linear` (or the quantized schemes' torch references), ranks talk over NCCL, and
the KV cache, LoRA slots and weights live on the device. None of that runs on the CPU
machines, so these tests are its only check: docs/rules-and-tests.md says how they are run on a
GPU machine (`RANKCAST_TEST_TOKENIZER_DIR` where the embedded model is not installed).

They hold the GPU to the same references as the CPU tests: transformers for logits and greedy
text, peft for adapters, the float model for quantized ones; and they check where things are
(a rank's device, its cache, its weights), because a path that quietly ran on the CPU would pass
every comparison.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rankcast import LoRARequest, SamplingParams
from rankcast.model.layers import PackedLinearMixin
from rankcast.model.linear_kernels import choose_linear_path
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.conftest import reference_greedy, write_tiny_model
from tests.entrypoints.server_process import ServerProcess, tiny_model_args
from tests.lora.conftest import MIXED_RANKS, lora_llm, make_adapter
from tests.model.test_llama_logits import VARIANTS
from tests.model.test_quantized_linears import ALL_SCHEMES, _as_if_from_a_4bit_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

GPU = torch.device("cuda", 0)
EXTENSION = "tests.worker.device_report:DeviceReport"
TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9], [1, 2, 3], [900, 800, 700, 600, 500, 400], [77, 78]]


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    """TF32 would round float32 matmuls to 10 mantissa bits; the references assume float32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _runner(model_dir: Path, dtype: torch.dtype, quantization: str = "none") -> ModelRunner:
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, dtype, GPU, quantization=quantization)
    runner = ModelRunner(model, arch, 4, GPU, dtype)
    runner.initialize_cache(64)
    return runner


def _logits(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int = 4,
    choices: list[list[int]] | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Each prompt's last logits, then `steps` decode steps of the batch (all rows), and the
    tokens fed: this runner's greedy choices, or `choices` (another model's, so that two
    models are compared on the same text). Block tables are scattered so paging cannot lean
    on adjacency."""
    tables = [[9, 2, 30, 4, 17, 1], [0, 11, 5, 40, 41, 7], [20, 21, 22, 23, 24, 25]]
    seqs = [list(p) for p in prompts]
    first = [ScheduledSequence("r", s, 0, t) for s, t in zip(seqs, tables, strict=False)]
    rows = [runner.compute_logits(SchedulerOutput(first)).float()]
    fed: list[list[int]] = [[] for _ in seqs]
    for step in range(steps):
        for i, (seq, row) in enumerate(zip(seqs, rows[-1], strict=True)):
            token = int(row.argmax()) if choices is None else choices[i][step]
            seq.append(token)
            fed[i].append(token)
        pairs = zip(seqs, tables, strict=False)
        batch = [ScheduledSequence("r", s[-1:], len(s) - 1, t) for s, t in pairs]
        rows.append(runner.compute_logits(SchedulerOutput(batch)).float())
    return torch.cat(rows), fed


def _transformers_logits(model_dir: Path, prompts: list[list[int]], steps: int = 4) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(GPU).eval()
    seqs = [list(p) for p in prompts]
    rows = []
    with torch.no_grad():
        for _ in range(steps + 1):
            last = [model(torch.tensor([s], device=GPU)).logits[0, -1].float() for s in seqs]
            rows.append(torch.stack(last))
            for seq, row in zip(seqs, last, strict=True):
                seq.append(int(row.argmax()))
    return torch.cat(rows)


def _prompts(count: int = 3, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 13, 1)[:count]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_on_the_gpu_match_transformers(tmp_path: Path, variant: str) -> None:
    """Prefill and decode logits in float32, every architecture variant the CPU tests cover."""
    model_dir = write_tiny_model(tmp_path / variant, vocab_size=256, seed=3, **VARIANTS[variant])
    assert choose_linear_path(torch.float32, GPU).kernel == "torch"
    runner = _runner(model_dir, torch.float32)
    assert runner.model.fused_layers is None
    assert {p.device.type for p in runner.model.parameters()} == {"cuda"}
    assert all(cache.device.type == "cuda" for cache in runner.kv_caches)
    got, _ = _logits(runner, _prompts())
    want = _transformers_logits(model_dir, _prompts())
    torch.testing.assert_close(got, want, atol=5e-4, rtol=0)


def test_bfloat16_on_the_gpu_stays_close_to_float32(tmp_path: Path) -> None:
    """bfloat16 (what `--dtype auto` picks on CUDA) within 5 % of the float32 logit range."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3)
    runner = _runner(model_dir, torch.bfloat16)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    want, choices = _logits(_runner(model_dir, torch.float32), _prompts())
    got, _ = _logits(runner, _prompts(), choices=choices)
    assert float((got - want).abs().max()) < 0.05 * float(want.max() - want.min())


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_quantized_weights_on_the_gpu_stay_close_to_the_float_model(
    tmp_path: Path, scheme: str
) -> None:
    """Every scheme's torch path on the device, with the CPU tests' bound (5 % of the float
    model's logit range; 4-bit groups as a Q4 file holds them)."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=256, seed=3, tie_word_embeddings=False)
    if scheme in ("q4_0", "q4_1"):
        _as_if_from_a_4bit_file(model_dir, scheme)
    quantized = _runner(model_dir, torch.bfloat16, scheme)
    linears = [m for m in quantized.model.modules() if isinstance(m, PackedLinearMixin)]
    packed = [m.packed_weight for m in linears if m.packed_weight is not None]
    assert packed and all(w.backend == "torch" and w.tensor.device.type == "cuda" for w in packed)
    want, choices = _logits(_runner(model_dir, torch.bfloat16), _prompts())
    got, _ = _logits(quantized, _prompts(), choices=choices)
    assert float((got - want).abs().max()) < 0.05 * float(want.max() - want.min())


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_engine_generates_on_the_gpu_what_transformers_generates(
    tiny_llama_dir: Path,
) -> None:
    """The offline engine's rank is on the GPU, and a batch's greedy text equals transformers'
    (on the CPU) for each prompt, with prefix caching and chunked prefill (8-token chunks)."""
    from rankcast import LLM

    shared = list(range(100, 140))
    prompts = [*PROMPTS, [*shared, 1, 2], [*shared, 3]]
    want = [reference_greedy(tiny_llama_dir, p, TOKENS) for p in prompts]
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_space_gib=0.05,
        max_num_seqs=8,
        max_num_batched_tokens=8,
        worker_extension_cls=EXTENSION,
    ) as llm:
        (report,) = llm.collective_rpc("device_report")
        assert report == {
            "device": "cuda:0",
            "dtype": "torch.float32",
            "cache": "cuda:0",
            "weights": "cuda:0",
        }
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        # Again: the shared prefix now comes from the cache.
        assert _tokens(llm.generate(prompts[-2:], GREEDY)) == want[-2:]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Real PEFT adapters of ranks 4, 8 and 2 on the tiny model."""
    root = tmp_path_factory.mktemp("cuda-adapters")
    for rank in MIXED_RANKS:
        make_adapter(tiny_llama_dir, root / f"r{rank}", rank=rank, alpha=2 * rank)
    return [root / f"r{rank}" for rank in MIXED_RANKS]


def test_adapters_on_the_gpu_generate_what_peft_generates(
    tiny_llama_dir: Path, adapters: list[Path]
) -> None:
    """LoRA slots on the device: each adapter alone equals peft, and a batch mixing three
    adapters and the base model equals each alone (two slots, so adapters also take turns)."""
    requests: list[LoRARequest | None] = [LoRARequest(p.name, str(p)) for p in adapters]
    requests.append(None)
    with lora_llm(tiny_llama_dir, max_loras=2, worker_extension_cls=EXTENSION) as llm:
        (report,) = llm.collective_rpc("device_report")
        assert report["device"] == "cuda:0"
        alone = [
            _tokens(llm.generate([prompt], GREEDY, lora_request=request))[0]
            for prompt, request in zip(PROMPTS, requests, strict=True)
        ]
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests)) == alone
    for prompt, adapter, tokens in zip(PROMPTS, adapters, alone, strict=False):
        assert tokens == reference_greedy(tiny_llama_dir, prompt, TOKENS, adapter)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has a GPU per rank")
def test_more_ranks_per_engine_than_gpus_is_a_clear_error(tiny_llama_dir: Path) -> None:
    """Two TP ranks on one GPU would fail inside NCCL ("duplicate GPU"); the start says which
    flags ask for it and how to run anyway."""
    from rankcast import LLM

    with pytest.raises(Exception, match="need as many CUDA devices") as failure:
        LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2, kv_cache_space_gib=0.05)
    assert "CUDA_VISIBLE_DEVICES" in str(failure.value)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_two_gpus_generates_what_one_does(tiny_llama_dir: Path) -> None:
    """TP=2 over NCCL gives the single rank's greedy text, each rank on its own GPU."""
    from rankcast import LLM

    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05) as llm:
        want = _tokens(llm.generate(PROMPTS, GREEDY))
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_space_gib=0.05,
        worker_extension_cls=EXTENSION,
    ) as llm:
        devices = [r["device"] for r in llm.collective_rpc("device_report")]
        assert devices == ["cuda:0", "cuda:1"]
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == want


def test_served_on_the_gpu_by_two_engines_and_two_api_servers(tiny_llama_dir: Path) -> None:
    """`rankcast serve` with two data-parallel engines (sharing one GPU where there is one):
    every rank reports the device, both engines answer completions, and both API servers'
    `/metrics` count the requests of both engines (the channel, on CUDA)."""
    args = ("--data-parallel-size", "2", "--routing-policy", "load")
    server = ServerProcess(
        *tiny_model_args(tiny_llama_dir, *args, "--worker-extension-cls", EXTENSION),
        api_server_count=2,
    )
    with server.running(), httpx.Client(timeout=60) as http:
        reply = http.post(f"{server.url}/collective_rpc", json={"method": "device_report"})
        assert reply.status_code == 200, reply.text
        reports = _flatten(reply.json()["results"])
        assert len(reports) == 2 and all(r["device"].startswith("cuda:") for r in reports)
        engines = set()
        for i in range(8):
            body = {"prompt": PROMPTS[i % 4], "max_tokens": 6, "temperature": 0}
            response = http.post(f"{server.url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 6
            engines.add(response.headers["x-rankcast-engine"])
        assert engines == {"0", "1"}
        finished: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while len(finished) < 2 or min(finished.values()) < 8:
            assert time.monotonic() < deadline, f"finished requests per API server: {finished}"
            with httpx.Client(timeout=10) as fresh:  # a new connection may reach either server
                metrics = fresh.get(f"{server.url}/metrics")
            finished[metrics.headers["x-rankcast-api-server"]] = _requests_finished(metrics.text)
            time.sleep(0.1)
        assert set(finished.values()) == {8.0}


def _flatten(results: list[Any]) -> list[Any]:
    """Per-engine, per-rank replies as one list."""
    flat: list[Any] = []
    for item in results:
        flat.extend(_flatten(item) if isinstance(item, list) else [item])
    return flat


def _requests_finished(text: str) -> float:
    """Finished requests over every engine in one `/metrics` exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
