"""A GGUF file's Q6_K LM head kept through the conversion and multiplied as stored
(rankcast/model_files/stored_head.py, csrc/gemm_q6k.cpp): the file's own weights, in its own
bytes, on every rank's share of the vocabulary, from a snapshot too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rankcast import kernels
from rankcast.distributed import TensorParallelGroup
from rankcast.model import ops
from rankcast.model.loader import load_model
from rankcast.model.quantization import q6_k_linear_reference, unpack_q6_k
from rankcast.model.weight_snapshot import wait_for_writes
from rankcast.model_files.arch import ArchConfig
from rankcast.model_files.source import resolve_model
from rankcast.model_files.stored_head import STORED_HEAD_FILE, STORED_HEAD_TENSOR
from tests.conftest import TINY_LLAMA, write_tiny_model
from tests.model.family_models import random_q6_k_rows, tiny_llama_gguf_writer

CPU = torch.device("cpu")
HIDDEN = 256  # Q6_K blocks are 256 wide
VOCAB = 49152  # the embedded tokenizer's


def _write_gguf(
    path: Path, model_dir: Path, embedded_gguf: Path, head: np.ndarray, tied: bool = False
) -> Path:
    """The tiny checkpoint as a llama GGUF whose layers and embedding are Q8_0 and whose `output`
    is `head`'s Q6_K blocks, as llama-quantize keeps it under 4- and 8-bit layers; `tied`: no
    `output`, the embedding (which the head reads) is `head`'s blocks. Q and K are not permuted
    as llama.cpp would: the tests compare the file with itself."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    rope_theta = float(TINY_LLAMA["rope_theta"])  # type: ignore[arg-type]
    writer = tiny_llama_gguf_writer(path, config, rope_theta, embedded_gguf)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if gguf_name == ("token_embd.weight" if tied else "output.weight"):
            continue
        array = tensor.float().numpy()
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, q8), raw_dtype=q8)
    head_name = "token_embd.weight" if tied else "output.weight"
    writer.add_tensor(head_name, head, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_file(folder: Path, embedded_gguf: Path, tied: bool) -> tuple[Path, np.ndarray]:
    model_dir = write_tiny_model(
        folder / "hf",
        seed=7,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=2,
        tie_word_embeddings=tied,
    )
    head = random_q6_k_rows(VOCAB, HIDDEN, seed=8).numpy()
    return _write_gguf(folder / "q6k-head.gguf", model_dir, embedded_gguf, head, tied), head


@pytest.fixture(scope="module")
def q6_k_file(
    tmp_path_factory: pytest.TempPathFactory, embedded_gguf: Path
) -> Iterator[tuple[Path, np.ndarray]]:
    """One file (and its conversion, in a cache of the module's) for the module's tests."""
    folder = tmp_path_factory.mktemp("q6k-head")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RANKCAST_CACHE_DIR", str(folder / "cache"))
        patch.delenv("RANKCAST_WEIGHT_SNAPSHOTS", raising=False)
        yield _tiny_file(folder, embedded_gguf, tied=False)


def _needs_q6_k_kernel() -> None:
    if not ops.q6_k_supported():
        pytest.skip("this build has no Q6_K kernel (AVX-512 builds only): the head is q8_0")


def test_the_conversion_keeps_the_heads_blocks_as_stored(
    q6_k_file: tuple[Path, np.ndarray],
) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    path, head = q6_k_file
    model_dir = resolve_model(str(path)).model_dir
    stored = load_file(str(model_dir / STORED_HEAD_FILE))[STORED_HEAD_TENSOR]
    assert stored.dtype == torch.uint8 and torch.equal(stored, torch.from_numpy(head))
    floats = load_file(str(model_dir / "model.safetensors"))["lm_head.weight"]
    want = dequantize(head, GGMLQuantizationType.Q6_K).reshape(VOCAB, HIDDEN)
    assert torch.equal(floats, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))
    assert not list(model_dir.glob("*.q6_k.safetensors"))  # never read as checkpoint weights


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_every_ranks_head_multiplies_its_rows_of_the_files_blocks(
    q6_k_file: tuple[Path, np.ndarray], quantization: str
) -> None:
    """Under a group scheme each rank's head packs its rows of the stored blocks (the last
    rank's padded with zero rows) and computes what the reference computes from the file's
    bytes; under `none` the head is the float conversion's."""
    _needs_q6_k_kernel()
    path, head = q6_k_file
    model_dir = resolve_model(str(path)).model_dir
    arch = ArchConfig.from_model_dir(model_dir)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    d, sc, q = unpack_q6_k(torch.from_numpy(head))
    want = q6_k_linear_reference(x, d, sc, q, None)
    parts = []
    for rank in range(2):
        tp = TensorParallelGroup(rank=rank, size=2)
        model = load_model(model_dir, arch, torch.float32, CPU, tp=tp, quantization=quantization)
        assert model.lm_head is not None and model.lm_head.packed_weight is not None
        assert model.lm_head.packed_weight.quantization == "q6_k"
        parts.append(model.lm_head.matmul(x, model.lm_head.weight, None))
    got = torch.cat(parts, dim=1)[:, :VOCAB]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # float sums in another order
    plain = load_model(model_dir, arch, torch.float32, CPU, quantization="none")
    assert plain.lm_head is not None and plain.lm_head.packed_weight is not None
    assert plain.lm_head.packed_weight.quantization == "none"


def test_a_snapshot_keeps_the_stored_head(q6_k_file: tuple[Path, np.ndarray]) -> None:
    """A start that maps its snapshot gets the same packed Q6_K head it packed from the file;
    the snapshot is keyed apart from one whose head was q8_0 (a build without the kernel)."""
    _needs_q6_k_kernel()
    from rankcast.model.weight_snapshot import WeightSnapshot

    path, _ = q6_k_file
    model_dir = resolve_model(str(path)).model_dir
    arch = ArchConfig.from_model_dir(model_dir)

    def load() -> torch.Tensor:
        model = load_model(
            model_dir, arch, torch.float32, CPU, weight_snapshots=True, quantization="q8_0"
        )
        assert model.lm_head is not None and model.lm_head.packed_weight is not None
        assert model.lm_head.packed_weight.quantization == "q6_k"
        return model.lm_head.packed_weight.tensor

    first = load()
    wait_for_writes()
    snapshot = WeightSnapshot.for_rank(
        model_dir, torch.float32, CPU, None, None, "rankcast", "q8_0", stored_head=True
    )
    assert snapshot is not None and snapshot.path.is_file()
    os.utime(snapshot.path, (1_000_000, 1_000_000))  # used long ago
    assert torch.equal(load(), first)
    assert snapshot.path.stat().st_mtime > 1_000_000  # the mapping start marked it used
    other = WeightSnapshot.for_rank(model_dir, torch.float32, CPU, None, None, "rankcast", "q8_0")
    assert other is not None and other.path != snapshot.path


def test_an_engine_serves_the_stored_head_the_same_alone_and_batched(
    q6_k_file: tuple[Path, np.ndarray],
) -> None:
    """An engine on the file (`--quantization auto`: its Q8_0 layers as q8_0, its head as
    Q6_K): each prompt's greedy tokens are the same alone as in a batch of three."""
    _needs_q6_k_kernel()
    from rankcast import LLM, SamplingParams

    path, _ = q6_k_file
    llm = LLM(str(path), kv_cache_space_gib=0.05, dtype="bfloat16", quantization="auto")
    try:
        worker = llm.engine.client.core.executor.worker
        assert worker.runner is not None
        head = worker.runner.model.lm_head
        assert head is not None and head.packed_weight is not None
        assert head.packed_weight.quantization == "q6_k"
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = ["The capital of France", "Once upon a time", "def fibonacci(n):"]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert batched == alone
        assert all(len(tokens) == 12 for tokens in batched)
    finally:
        llm.shutdown()


def test_without_the_kernel_or_under_no_group_scheme_the_head_is_not_q6_k(
    q6_k_file: tuple[Path, np.ndarray],
) -> None:
    """A build without the Q6_K kernel (AVX2) serves the same file with a q8_0 head, from the
    float conversion; so does any start whose head takes no group scheme."""
    path, _ = q6_k_file
    model_dir = resolve_model(str(path)).model_dir
    arch = ArchConfig.from_model_dir(model_dir)
    if not kernels.load():
        pytest.skip("the kernels are not built here")
    model = load_model(model_dir, arch, torch.float32, CPU, quantization="q8_0")
    assert model.lm_head is not None and model.lm_head.packed_weight is not None
    expected = "q6_k" if ops.q6_k_supported() else "q8_0"
    assert model.lm_head.packed_weight.quantization == expected
    int8 = load_model(model_dir, arch, torch.float32, CPU, quantization="int8")
    assert int8.lm_head is not None and int8.lm_head.packed_weight is not None
    assert int8.lm_head.packed_weight.quantization == "int8"


def test_a_tied_head_multiplies_the_embeddings_blocks(
    tmp_path: Path, embedded_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file without `output` (the head reads the embedding, as small models tie them) whose
    embedding is Q6_K: the conversion keeps the embedding's blocks for the head, which packs
    them, while the embedding itself keeps the float conversion's rows."""
    from safetensors.torch import load_file

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    path, head = _tiny_file(tmp_path, embedded_gguf, tied=True)
    model_dir = resolve_model(str(path)).model_dir
    stored = load_file(str(model_dir / STORED_HEAD_FILE))[STORED_HEAD_TENSOR]
    assert torch.equal(stored, torch.from_numpy(head))
    _needs_q6_k_kernel()
    arch = ArchConfig.from_model_dir(model_dir)
    assert arch.tie_word_embeddings
    model = load_model(model_dir, arch, torch.float32, CPU, quantization="q4_1")
    assert model.lm_head is not None and model.lm_head.packed_weight is not None
    assert model.lm_head.packed_weight.quantization == "q6_k"
    assert model.embed_tokens is not None
    floats = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, floats)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(4))
    want = q6_k_linear_reference(x, *unpack_q6_k(torch.from_numpy(head)), None)
    got = model.lm_head.matmul(x, model.lm_head.weight, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
