"""PEFT adapters as `peft` writes them: read, scaled and sharded right, and every bad one refused
with an error that names the file and the problem."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankcast.errors import ClientError
from rankcast.lora.peft_adapter import LoRAAdapterError, inspect_peft_adapter, load_peft_adapter
from rankcast.model_files.arch import ArchConfig
from tests.lora.conftest import TARGETS, make_adapter


@pytest.fixture(scope="module")
def arch(tiny_llama_dir: Path) -> ArchConfig:
    return ArchConfig.from_model_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapters") / "a4"
    make_adapter(tiny_llama_dir, out)
    return out


def test_an_adapter_reads_with_its_scaling_and_applies_like_peft(
    tiny_llama_dir: Path, tmp_path: Path, arch: ArchConfig
) -> None:
    model = make_adapter(tiny_llama_dir, tmp_path / "a")
    adapter = load_peft_adapter("a", tmp_path / "a", arch, max_lora_rank=16)
    assert (adapter.rank, adapter.scaling) == (4, 2.0)
    assert adapter.target_modules == frozenset(TARGETS)
    assert len(adapter.weights) == len(TARGETS) * arch.num_hidden_layers
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, arch.intermediate_size)
    with torch.no_grad():
        want = layer(x) - layer.base_layer(x)
        w = adapter.weights[(1, "down_proj")]
        got = adapter.scaling * (x @ w.a.T) @ w.b.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rslora_scales_by_the_square_root_of_the_rank(
    tiny_llama_dir: Path, tmp_path: Path, arch: ArchConfig
) -> None:
    make_adapter(tiny_llama_dir, tmp_path / "rs", rank=8, alpha=16, use_rslora=True)
    adapter = load_peft_adapter("rs", tmp_path / "rs", arch, max_lora_rank=8)
    assert adapter.scaling == pytest.approx(16 / math.sqrt(8))


def _copy(adapter_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(adapter_dir, target)
    return target


def _edit_config(path: Path, **changes: object) -> None:
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _edit_tensors(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file(edit(tensors), str(weights))


def _rename_first_a(tensors: dict, module: str) -> dict:
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key.replace("q_proj", module)] = tensors.pop(key)
    return tensors


def _widen_first_b(tensors: dict) -> dict:
    key = next(k for k in tensors if "up_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    return tensors


BAD_ADAPTERS = {
    "missing config": (
        lambda p: (p / "adapter_config.json").unlink(),
        "adapter_config.json: missing",
    ),
    "unreadable config": (
        lambda p: (p / "adapter_config.json").write_text("{not json"),
        "adapter_config.json: unreadable",
    ),
    "missing weights": (
        lambda p: (p / "adapter_model.safetensors").unlink(),
        "adapter_model.safetensors: missing",
    ),
    "truncated weights": (
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10\x00"),
        "adapter_model.safetensors: unreadable",
    ),
    "rank over the limit": (lambda p: _edit_config(p, r=64), "rank 64 exceeds --max-lora-rank 16"),
    "bias": (lambda p: _edit_config(p, bias="all"), "bias 'all' is not supported"),
    "dora": (lambda p: _edit_config(p, use_dora=True), "use_dora is not supported"),
    "unknown module": (
        lambda p: _edit_tensors(p, lambda t: _rename_first_a(t, "rotary")),
        "targets 'rotary'",
    ),
    "shape mismatch": (lambda p: _edit_tensors(p, _widen_first_b), "expected (160, 4)"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_a_bad_adapter_is_refused_naming_the_problem(
    case: str, adapter_dir: Path, tmp_path: Path, arch: ArchConfig
) -> None:
    spoil, message = BAD_ADAPTERS[case]
    path = _copy(adapter_dir, tmp_path)
    spoil(path)
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_peft_adapter("bad", path, arch, max_lora_rank=16)


def test_paths_outside_the_allowed_roots_are_refused_even_through_a_symlink(
    adapter_dir: Path, tmp_path: Path, arch: ArchConfig
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with pytest.raises(LoRAAdapterError, match="allowed roots"):
        load_peft_adapter("a", adapter_dir, arch, 16, allowed_roots=[allowed])
    (allowed / "link").symlink_to(adapter_dir)
    with pytest.raises(LoRAAdapterError, match="allowed roots"):
        load_peft_adapter("a", allowed / "link", arch, 16, allowed_roots=[allowed])
    inside = allowed / "real"
    shutil.copytree(adapter_dir, inside)
    assert load_peft_adapter("a", inside, arch, 16, allowed_roots=[allowed]).rank == 4


def test_a_nul_byte_in_the_path_is_the_callers_error_naming_it(arch: ArchConfig) -> None:
    """The OS refuses such a path with a bare ValueError, which would be the engine's own
    (`internal`, a 500); it is the caller's, so the API server answers 400."""
    for check in (
        lambda: inspect_peft_adapter("/tmp/a\x00b", arch, 16),
        lambda: load_peft_adapter("a", "/tmp/a\x00b", arch, 16),
    ):
        with pytest.raises(LoRAAdapterError, match=r"'/tmp/a\\x00b': a path cannot contain a NUL"):
            check()
    assert issubclass(LoRAAdapterError, ClientError)
