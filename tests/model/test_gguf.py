"""The embedded GGUF: conversion, equality with transformers' own GGUF loading, and bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rankcast.model_files.arch import ModelFormatError
from rankcast.model_files.gguf_convert import (
    cache_key,
    convert_gguf,
    hf_tensor_name,
    undo_rope_permute,
)
from rankcast.model_files.source import resolve_model
from tests.conftest import TINY_LLAMA
from tests.model.family_models import tiny_llama_gguf_writer
from tests.model.gguf_reference import NEW_TOKENS, PROMPTS, reference_continuations


def test_undo_rope_permute_inverts_llama_cpp_layout() -> None:
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: reshape(heads, 2, dim/2, ...) then swap the two middle axes.
    gguf = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(undo_rope_permute(gguf, heads), hf)


def test_tensor_names_map_to_hf() -> None:
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_embedded_model_config_comes_from_gguf_metadata(embedded_model_dir: Path) -> None:
    from rankcast.model_files.arch import ArchConfig

    arch = ArchConfig.from_model_dir(embedded_model_dir)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert arch.hidden_size == 576 and arch.vocab_size == 49152 and arch.tie_word_embeddings
    assert (embedded_model_dir / "tokenizer.json").is_file()
    assert (
        "im_start" in (embedded_model_dir / "tokenizer_config.json").read_text()
        or (embedded_model_dir / "chat_template.jinja").is_file()
    )


def test_tokenizer_from_gguf_metadata_equals_transformers_autotokenizer(
    embedded_gguf: Path, tmp_path: Path
) -> None:
    """The cold start builds the tokenizer with transformers' GGUF converter directly; the
    files it writes are those `AutoTokenizer.from_pretrained(gguf_file=...)` writes."""
    pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from rankcast.model_files.gguf_convert import _tokenizer_from_gguf_metadata, _tokenizer_via_auto

    direct, auto = tmp_path / "direct", tmp_path / "auto"
    _tokenizer_from_gguf_metadata(embedded_gguf).save_pretrained(str(direct))
    _tokenizer_via_auto(embedded_gguf).save_pretrained(str(auto))
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (direct / name).read_bytes() == (auto / name).read_bytes(), name
    configs = [json.loads((d / "tokenizer_config.json").read_text()) for d in (direct, auto)]
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token"):
        assert configs[0].get(key) == configs[1].get(key), key
    assert configs[0]["eos_token"] == "<|im_end|>"


def test_greedy_continuations_match_transformers_generate(smollm_fp32, embedded_gguf: Path) -> None:
    """64 greedy tokens of 4 prompts, token for token, against transformers' own GGUF loader
    (recorded for this GGUF's bytes, live for any other: tests/model/gguf_reference.py)."""
    from rankcast import SamplingParams

    tokenizer = smollm_fp32.get_tokenizer()
    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    want = reference_continuations(embedded_gguf, prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smollm_fp32.generate(PROMPTS, params)
    for prompt, output, continuation in zip(PROMPTS, ours, want, strict=True):
        assert len(continuation) == NEW_TOKENS
        assert output.outputs[0].token_ids == continuation, prompt


def test_cache_key_changes_with_file_identity(tmp_path: Path) -> None:
    a = tmp_path / "m.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 10)
    key = cache_key(a)
    a.write_bytes(b"GGUF" + b"\0" * 11)
    assert cache_key(a) != key


def test_missing_model_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match=r"nope\.gguf: model path not found"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_non_gguf_file_is_rejected_with_its_name(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelFormatError, match=r"weights.gguf: not a GGUF file"):
        resolve_model(str(bogus))


def test_truncated_gguf_is_rejected_with_its_name(
    tmp_path: Path, embedded_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    truncated = tmp_path / "half.gguf"
    with embedded_gguf.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(embedded_gguf.stat().st_size // 2))
    with pytest.raises(ModelFormatError, match=r"half.gguf: GGUF file is truncated or corrupt"):
        convert_gguf(truncated)
    assert not any((tmp_path / "cache").rglob("*.safetensors")), "no partial cache left behind"


def test_hf_directory_errors_name_the_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from rankcast import LLM

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFormatError, match=r"config.json: not found"):
        resolve_model(str(empty))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    with pytest.raises(ModelFormatError, match=r"model.safetensors: "):
        LLM(str(broken), kv_cache_space_gib=0.05)
    unsupported = tmp_path / "unsupported"
    shutil.copytree(tiny_llama_dir, unsupported)
    config = unsupported / "config.json"
    config.write_text(config.read_text().replace("LlamaForCausalLM", "MambaForCausalLM"))
    with pytest.raises(ModelFormatError, match=r"architecture 'MambaForCausalLM' is not supported"):
        LLM(str(unsupported), kv_cache_space_gib=0.05)


def test_a_gguf_whose_tokenizer_cannot_be_rebuilt_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is rebuilt in a process of its own beside the dequantization; its failure
    still names the file, and no half-written cache is left."""
    import gguf

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "odd-tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("no-such-tokenizer-kind")
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelFormatError, match=r"odd-tokenizer\.gguf: tokenizer metadata cannot be read"
    ):
        convert_gguf(path)
    assert not any((tmp_path / "cache").rglob("*.safetensors")), "no partial cache left behind"


def test_our_reader_parses_what_ggufs_own_reader_parses(tmp_path: Path) -> None:
    """open_gguf parses over a plain array view of the mapping (a speed-up, see
    _fast_gguf_parsing): every field's parts and every tensor equal the library's own reader's,
    and gguf's module is left as it was."""
    import gguf
    import gguf.gguf_reader

    from rankcast.model_files.gguf_convert import open_gguf

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_merges([f"t o{i}" for i in range(200)])
    writer.add_token_scores([float(i) / 7 for i in range(300)])
    writer.add_tensor("token_embd.weight", np.arange(300 * 8, dtype=np.float32).reshape(300, 8))
    writer.add_tensor("output_norm.weight", np.full(8, 0.5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert gguf.gguf_reader.np is np
    assert ours.fields.keys() == theirs.fields.keys()
    for key, field in theirs.fields.items():
        assert [bytes(p) for p in ours.fields[key].parts] == [bytes(p) for p in field.parts], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(mine.data, reference.data)


def test_a_conversion_records_its_source(embedded_model_dir: Path, embedded_gguf: Path) -> None:
    from rankcast.model_files.gguf_convert import source_identity

    record = embedded_model_dir / "rankcast-source.txt"
    assert record.read_text() == source_identity(embedded_gguf)


def test_pruning_removes_conversions_no_start_can_use(tmp_path: Path) -> None:
    """Every reinstall of a model package converts into a directory of its own; the ones whose
    source is gone or changed, or that do not say what it was, go at the next conversion."""
    import os
    import subprocess
    import sys

    from rankcast.model_files.gguf_convert import prune_stale_conversions, source_identity

    sources = tmp_path / "sources"
    sources.mkdir()
    cache = tmp_path / "gguf"
    cache.mkdir()

    def conversion(name: str, source: Path | None) -> Path:
        entry = cache / name
        entry.mkdir()
        (entry / "model.safetensors").write_bytes(b"weights")
        if source is not None:
            (entry / "rankcast-source.txt").write_text(source_identity(source))
        return entry

    kept_source, changed_source, gone_source = (sources / f"{n}.gguf" for n in "abc")
    for source in (kept_source, changed_source, gone_source):
        source.write_bytes(b"GGUF")
    kept = conversion("a-1", kept_source)
    changed = conversion("b-1", changed_source)
    gone = conversion("c-1", gone_source)
    unrecorded = conversion("d-1", None)
    changed_source.write_bytes(b"GGUF, reinstalled")
    gone_source.unlink()
    code = "import os; print(os.getpid())"
    dead_pid = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    dead_staging = cache / f".staging-{dead_pid}-x"
    live_staging = cache / f".staging-{os.getpid()}-y"
    dead_staging.mkdir()
    live_staging.mkdir()
    stray_file = cache / "notes.txt"
    stray_file.write_text("not a conversion")

    removed = set(prune_stale_conversions(cache))
    assert removed == {changed, gone, unrecorded, dead_staging}
    assert all(not path.exists() for path in removed)
    assert kept.is_dir() and live_staging.is_dir() and stray_file.is_file()


def test_8bit_groups_are_a_q8_0_files_own_values() -> None:
    """What `gguf` (llama.cpp's encoding) writes for a Q8_0 tensor, dequantized as the converter
    does, quantizes back to the file's very q and d: `--quantization q8_0` (or auto) serves the
    file's weights, not a second rounding of them."""
    import gguf
    import torch

    from rankcast.model.quantization import quantize_q8_0_weight

    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    weight = (np.random.default_rng(0).standard_normal((40, 96)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weight, Q8_0)
    values, scales = quantize_q8_0_weight(torch.from_numpy(gguf.quants.dequantize(raw, Q8_0)))
    blocks = raw.reshape(40, 3, 34)  # per block of 32: float16 d, then 32 int8 q
    assert np.array_equal(blocks[..., :2].copy().view(np.float16)[..., 0], scales.numpy())
    assert np.array_equal(blocks[..., 2:].copy().view(np.int8).reshape(40, 96), values.numpy())


def test_4bit_groups_are_a_q4_0_files_own_values() -> None:
    """The same for Q4_0 (w = d * (q - 8)), served through the Q4_1 kernel with m = -8 d."""
    import gguf
    import torch

    from rankcast.model.quantization import quantize_q4_0_weight

    Q4_0 = gguf.GGMLQuantizationType.Q4_0
    weight = (np.random.default_rng(1).standard_normal((40, 96)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weight, Q4_0)
    values, scales, minimums = quantize_q4_0_weight(
        torch.from_numpy(gguf.quants.dequantize(raw, Q4_0))
    )
    blocks = raw.reshape(40, 3, 18)  # per block of 32: float16 d, then 16 bytes of two nibbles
    assert np.array_equal(blocks[..., :2].copy().view(np.float16)[..., 0], scales.numpy())
    nibbles = np.concatenate([blocks[..., 2:] & 15, blocks[..., 2:] >> 4], axis=-1)
    assert np.array_equal(nibbles.reshape(40, 96), values.numpy())
    assert torch.equal(minimums.float(), scales.float() * -8)


def test_auto_quantization_serves_a_gguf_in_its_own_format(
    tmp_path: Path, embedded_gguf: Path, tiny_llama_dir: Path
) -> None:
    """`--quantization auto`: the embedded file's decoder projections are Q4_1, so it is served
    as q4_1; a file of Q8_0 (Q4_0) projections as q8_0 (q4_0); a file whose projections are
    float, and an HF directory, as "none" (a mix of quantized types: the test below)."""
    import gguf

    from rankcast.model_files.gguf_convert import native_quantization
    from rankcast.model_files.source import ModelSource

    assert native_quantization(embedded_gguf) == "q4_1"
    path = tmp_path / "float.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert native_quantization(path) == "none"
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    q8 = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(q8), "llama")
    writer.add_block_count(1)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        raw = gguf.quants.quantize(np.ones((32, 64), dtype=np.float32), Q8_0)
        writer.add_tensor(name, raw, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert native_quantization(q8) == "q8_0"
    q4 = tmp_path / "q4_0.gguf"
    writer = gguf.GGUFWriter(str(q4), "llama")
    writer.add_block_count(1)
    raw = gguf.quants.quantize(np.ones((32, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert native_quantization(q4) == "q4_0"
    source = ModelSource(tiny_llama_dir, tiny_llama_dir, "tiny")
    assert source.quantization("auto") == "none" and source.quantization("int8") == "int8"
    embedded = ModelSource(embedded_gguf, tiny_llama_dir, "smol", native_quantization="q4_1")
    assert embedded.quantization("auto") == "q4_1" and embedded.quantization("none") == "none"


def test_a_start_from_the_conversion_cache_reads_the_recorded_quantization(
    tmp_path: Path, embedded_gguf: Path, embedded_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion records the file's native quantization, and a start from the cache takes
    it from there instead of parsing the GGUF's metadata again (~1.2 s of every warm start); a
    conversion made before the record gets one on its next start."""
    from rankcast.model_files.gguf_convert import cached_model_dir

    record = embedded_model_dir / "rankcast-native-quantization.txt"
    assert record.read_text() == "q4_1"
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    older = cached_model_dir(embedded_gguf)  # the same conversion, less the record
    older.mkdir(parents=True)
    for entry in embedded_model_dir.iterdir():
        if entry != record:
            (older / entry.name).symlink_to(entry)
    assert resolve_model(None).native_quantization == "q4_1"
    assert (older / record.name).read_text() == "q4_1"
    (older / record.name).write_text("q8_0")  # what is recorded is what a start reads
    assert resolve_model(None).native_quantization == "q8_0"
    (older / record.name).write_text("q4_")  # a record cut short is made again from the file
    assert resolve_model(None).native_quantization == "q4_1"
    assert (older / record.name).read_text() == "q4_1"


def test_8bit_groups_keep_a_q5_0_or_q4_0_files_own_values() -> None:
    """Q5_0 (w = d * (q - 16)) and Q4_0 tensors, which llama.cpp's K-quant mixes write where rows
    are not a multiple of 256 wide (SmolLM2's 576), run through the 8-bit kernel with the file's
    own d and integers (Q4_0's as the even steps of d / 2): nothing is rounded a second time."""
    import gguf
    import torch

    from rankcast.model.quantization import quantize_q8_0_weight

    for kind, per_step, seed in (("Q5_0", 1, 2), ("Q4_0", 2, 3)):
        weight_type = gguf.GGMLQuantizationType[kind]
        weight = (np.random.default_rng(seed).standard_normal((40, 96)) * 0.05).astype(np.float32)
        raw = gguf.quants.quantize(weight, weight_type)
        from_file = gguf.quants.dequantize(raw, weight_type)
        values, scales = quantize_q8_0_weight(torch.from_numpy(from_file))
        file_d = raw.reshape(40, 3, -1)[..., :2].copy().view(np.float16)[..., 0]
        assert np.array_equal(scales.numpy() * per_step, file_d), kind
        assert int(values.abs().max()) <= 16 and bool((values % per_step == 0).all())
        rebuilt = values.view(40, 3, 32).float() * scales.float()[..., None]
        assert torch.equal(rebuilt.view(40, 96), torch.from_numpy(from_file)), kind


def _write_gguf_mix(path: Path, model_dir: Path, embedded_gguf: Path, types: dict) -> None:
    """The tiny checkpoint in `model_dir` as a GGUF file whose tensors have `types` (by GGUF
    tensor kind; unnamed 2-D tensors Q8_0, norms F32), with the embedded file's tokenizer.
    Q and K are not permuted as llama.cpp would: the test compares the file with itself."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    rope_theta = float(TINY_LLAMA["rope_theta"])  # type: ignore[arg-type]
    writer = tiny_llama_gguf_writer(path, config, rope_theta, embedded_gguf)
    names = {hf: gguf_name for gguf_name, hf in _gguf_names(config["num_hidden_layers"])}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name not in names:
            continue
        array = tensor.float().numpy()
        kind = names[name].split(".")[-2]
        if array.ndim == 1:
            writer.add_tensor(names[name], array)
            continue
        weight_type = gguf.GGMLQuantizationType[types.get(kind, "Q8_0")]
        writer.add_tensor(
            names[name], gguf.quants.quantize(array, weight_type), raw_dtype=weight_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_names(layers: int) -> list[tuple[str, str]]:
    """(GGUF name, HF name) of every tensor of a `layers`-layer llama without an LM head."""
    kinds = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    kinds += ["ffn_gate", "ffn_up", "ffn_down"]
    names = [f"blk.{i}.{kind}.weight" for i in range(layers) for kind in kinds]
    names += ["token_embd.weight", "output_norm.weight"]
    return [(name, str(hf_tensor_name(name))) for name in names]


def test_a_k_quant_mix_is_served_as_8bit_groups(
    tmp_path: Path, embedded_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of the kind llama.cpp's Q4_K_M / Q5_K_M write for SmolLM2 (Q5_0 or Q5_1 layers, Q8_0
    value projections and embedding, another type in the down projections) is served by `auto`
    as q8_0, end to end from the file: its logits stay within 2 % of the logit range of the same
    file served from its float conversion, and its Q5_0 and Q8_0 weights keep the file's values
    (the test above); a float projection anywhere makes `auto` serve the float weights."""
    import torch

    from rankcast.model.loader import load_model
    from rankcast.model_files.arch import ArchConfig
    from rankcast.protocol import ScheduledSequence, SchedulerOutput
    from rankcast.worker.model_runner import ModelRunner
    from tests.conftest import write_tiny_model

    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = write_tiny_model(tmp_path / "hf", seed=5)
    mix = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0"}
    mix |= {"ffn_up": "Q5_0", "ffn_down": "Q5_1"}
    path = tmp_path / "mix.gguf"
    _write_gguf_mix(path, model_dir, embedded_gguf, mix)
    source = resolve_model(str(path))
    assert source.quantization("auto") == "q8_0"
    arch = ArchConfig.from_model_dir(source.model_dir)
    cpu = torch.device("cpu")

    def logits(quantization: str) -> torch.Tensor:
        model = load_model(source.model_dir, arch, torch.float32, cpu, quantization=quantization)
        runner = ModelRunner(model, arch, 4, cpu, torch.float32)
        runner.initialize_cache(16)
        step = SchedulerOutput([ScheduledSequence("r", list(range(100, 131)), 0, list(range(8)))])
        got = runner.compute_logits(step)
        assert got is not None
        return got.float()

    want, got = logits("none"), logits("q8_0")
    assert float((got - want).abs().max()) < 0.02 * float(want.max() - want.min())
    float_layer = tmp_path / "float-layer.gguf"
    _write_gguf_mix(float_layer, model_dir, embedded_gguf, {**mix, "ffn_up": "F32"})
    assert resolve_model(str(float_layer)).quantization("auto") == "none"
