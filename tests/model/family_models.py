"""Tiny random-weight checkpoints of the Llama family's other members (Qwen3, SmolLM3, Phi-3,
Gemma 3, and the mixtures of experts Qwen3-MoE and Mixtral), built with transformers' own
config and model classes, and the GGUF file llama.cpp's converter would write from one: what
test_qwen3.py, test_smollm3.py, test_phi3.py, test_moe.py ... hold rankcast to."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Small enough for 2 cores, with the shapes that matter: grouped KV heads (4 / 2, so TP=2 gives
# each rank 2 query heads and 1 KV head), and the embedded tokenizer's 49,152 tokens so the
# engine serves it.
TINY = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_checkpoint(
    path: Path,
    model_type: str,
    tokenizer_from: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.08,
    **overrides: Any,
) -> Path:
    """A `model_type` ("qwen3", "smollm3", ..., "llama") checkpoint of random weights, saved
    as safetensors in `dtype` with the tokenizer copied in. Norm weights are random too
    (transformers starts them at one), so a norm the engine skipped or misplaced shows in the
    logits. The model is built in `dtype` (bench/models.py's 3B shape never exists in float32),
    its matrices drawn with `std` (smaller at real widths, so activations stay finite)."""
    import transformers

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = model_class(config_class(**{**TINY, **overrides}))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for param in model.parameters():
            # Matrices, and transformers' experts stacked as [experts, rows, columns].
            if param.dim() >= 2:
                param.normal_(0.0, std)
            else:
                param.normal_(1.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="100GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter (LlamaModel.permute) does to Q and K rows of the
    architectures it rotates the GPT-J way (llama, smollm3): each head's two halves
    interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@functools.cache
def tokenizer_fields(gguf_path: Path) -> tuple[tuple[str, Any, Any, Any], ...]:
    """The `tokenizer.*` fields of a GGUF file as (name, contents, type, array sub-type or
    None), what a `GGUFWriter.add_key_value` takes. Read once a session: gguf's reader parses a
    49k-token vocabulary and its merges in ~2 s, and every tiny GGUF a test writes carries the
    embedded model's tokenizer. The contents are shared: callers copy before changing them."""
    from rankcast.model_files.gguf_convert import open_gguf

    return tuple(
        (
            field.name,
            field.contents(),
            field.types[0],
            field.types[-1] if len(field.types) > 1 else None,
        )
        for field in open_gguf(gguf_path).fields.values()
        if field.name.startswith("tokenizer.")
    )


def random_q6_k_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Random Q6_K rows as a GGUF stores them (uint8 [rows, width / 256 * 210]): every bit
    pattern of the values and sub-block scales, a small float16 d per block (gguf's encoder has
    no Q6_K; llama-quantize writes these)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, width // 256, 210), dtype=torch.uint8, generator=gen)
    d = (torch.randn(rows, width // 256, generator=gen) * 0.002).half()
    blocks[..., 208:210] = d.view(torch.uint8).view(rows, width // 256, 2)
    return blocks.view(rows, -1)


def tiny_llama_gguf_writer(
    path: Path, config: dict[str, Any], rope_theta: float, tokenizer_gguf: Path
) -> Any:
    """A `gguf.GGUFWriter` for a tiny llama checkpoint (its `config.json`) with the metadata
    llama.cpp reads and `tokenizer_gguf`'s tokenizer written; the caller adds the tensors and
    writes the file. Q and K are the caller's to permute, where the test needs llama.cpp's order."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta)
    for name, contents, kind, sub_type in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(name, contents, kind, sub_type)
    return writer


def write_llama_cpp_gguf(
    path: Path,
    model_dir: Path,
    tokenizer_gguf: Path,
    projections: str = "F32",
    embeddings: str = "F32",
) -> Path:
    """`model_dir` as a float32 GGUF file named as llama.cpp's convert_hf_to_gguf.py names it:
    `general.architecture` the model type, its metadata keys, tensor names from gguf's own
    TensorNameMap (not rankcast's table), Q and K permuted where llama.cpp permutes them, and
    the tokenizer of `tokenizer_gguf`. Norms stay float32, as llama.cpp keeps them; the decoder
    layers' projections are stored as `projections` (a GGML type name: "Q8_0" as
    llama-quantize would write them), the embedding (and a separate output) as `embeddings`."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = {
        "qwen3": gguf.MODEL_ARCH.QWEN3,
        "smollm3": gguf.MODEL_ARCH.SMOLLM3,
        "phi3": gguf.MODEL_ARCH.PHI3,
        "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
        "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    }[model_type]
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    gemma = model_type == "gemma3_text"
    moe = model_type == "qwen3_moe"
    writer = gguf.GGUFWriter(str(path), "gemma3" if gemma else ("qwen3moe" if moe else model_type))
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base((rope["full_attention"] if gemma else rope)["rope_theta"])
    if "head_dim" in config:  # llama.cpp writes it where the HF config names one
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if model_type == "phi3":
        _add_phi3_metadata(writer, config)
    if gemma:
        _add_gemma3_metadata(writer, config)
    if moe:  # what llama.cpp's Qwen3MoeModel writes of the experts
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    for name, contents, kind, sub_type in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(name, _padded(name, contents, config["vocab_size"]), kind, sub_type)
    names = gguf.get_tensor_name_map(arch, layers)
    permutes = model_type == "smollm3"
    for name, tensor in _experts_stacked(load_file(str(model_dir / "model.safetensors"))):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = tensor.float().numpy()
        if gemma and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp's Gemma3Model.norm_shift
        if permutes and name.endswith("q_proj.weight"):
            array = permute_for_llama_cpp(array, heads)
        elif permutes and name.endswith("k_proj.weight"):
            array = permute_for_llama_cpp(array, kv_heads)
        stored = projections if gguf_name.startswith("blk.") else embeddings
        if gguf_name.endswith("ffn_gate_inp.weight"):
            stored = "F32"  # the router, kept float as llama.cpp keeps it
        if stored != "F32" and array.ndim >= 2:
            kind = gguf.GGMLQuantizationType[stored]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _experts_stacked(tensors: dict[str, Any]) -> list[tuple[str, Any]]:
    """The checkpoint's tensors with each layer's experts stacked per projection, as llama.cpp's
    converter stacks them before naming (`model.layers.N.mlp.experts.gate_proj.weight`,
    [experts, rows, columns], which its name map calls `blk.N.ffn_gate_exps`)."""
    out: list[tuple[str, Any]] = []
    stacks: dict[str, dict[int, Any]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            key = ".".join([*parts[: at + 1], *parts[at + 2 :]])
            stacks.setdefault(key, {})[int(parts[at + 1])] = tensor
        else:
            out.append((name, tensor))
    for key, experts in stacks.items():
        out.append((key, torch.stack([experts[i] for i in sorted(experts)])))
    return out


# llama.cpp's token type for a vocabulary slot no text maps to (its LLAMA_TOKEN_TYPE_UNUSED).
_UNUSED_TOKEN = 5


def _padded(name: str, value: Any, vocab_size: int) -> Any:
    """A tokenizer array padded to the model's vocabulary, as a checkpoint whose embedding has
    more rows than its tokenizer has tokens is converted (a real size's 151,936 or 262,144 rows
    with the embedded tokenizer's 49,152 tokens): llama.cpp sizes the embedding by the token
    list. Unused slots get names no text encodes to."""
    if name == "tokenizer.ggml.tokens" and len(value) < vocab_size:
        return [*value, *(f"<|unused_{i}|>" for i in range(len(value), vocab_size))]
    if name == "tokenizer.ggml.token_type" and len(value) < vocab_size:
        return [*value, *([_UNUSED_TOKEN] * (vocab_size - len(value)))]
    return value


def _add_phi3_metadata(writer: Any, config: dict[str, Any]) -> None:
    """What llama.cpp's Phi3MiniModel adds: the rotated width, the original context, the window
    (0 for none) and, with LongRoPE, the attention factor it computes and the two factor
    tensors."""
    import math

    rope = config["rope_parameters"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    original = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        )
        for key, name in (("long_factor", "long"), ("short_factor", "short")):
            values = np.asarray(rope[key], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{name}.weight", values)


def _add_gemma3_metadata(writer: Any, config: dict[str, Any]) -> None:
    """What llama.cpp's Gemma3Model adds: the window, the global layers' linear RoPE scaling,
    a final logit soft-cap where set. (The local layers, their RoPE base and the attention
    scale are not written: llama.cpp's loader assumes them, so the checkpoint must match.)"""
    import gguf

    writer.add_sliding_window(config["sliding_window"])
    full = config["rope_parameters"]["full_attention"]
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def stack_expected(dtype: torch.dtype) -> bool:
    """Whether a single rank runs its layers through the C++ decoder stack: wherever the linears
    take rankcast's packed kernel (`choose_linear_path`: the kernels built, an x86 CPU)."""
    from rankcast.model.linear_kernels import choose_linear_path

    return choose_linear_path(dtype, torch.device("cpu")).kernel == "rankcast"


def stack_and_modules_logits(
    model_dir: Path,
    dtype: torch.dtype,
    window_tables: list[list[int]] | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """One decode step's logits (after two prompts' prefill) through the C++ decoder stack and
    through the modules, from the same cache: the stack must give the modules' very bits.
    `window_tables`: the sequences' blocks in the sliding-window KV-cache group (Gemma 3), other
    than their main ones, so a layer reading the wrong group's blocks shows. `kv_cache_dtype`:
    what the cache holds (None: the activations' dtype)."""
    from rankcast.model.loader import load_model
    from rankcast.model_files.arch import ArchConfig
    from rankcast.protocol import ScheduledSequence, SchedulerOutput
    from rankcast.worker.model_runner import ModelRunner

    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, dtype, torch.device("cpu"))
    runner = ModelRunner(model, arch, 16, torch.device("cpu"), dtype, None, kv_cache_dtype)
    runner.initialize_cache(16)
    assert runner.model.fused_layers is not None
    prompts = [[5, 9, 200, 31, 7], list(range(40, 61))]
    tables = [[3, 8], [0, 12]]
    windows = window_tables or [None] * len(prompts)
    prefill = [
        ScheduledSequence("r", p, 0, t, window_block_ids=w)
        for p, t, w in zip(prompts, tables, windows, strict=True)
    ]
    runner.compute_logits(SchedulerOutput(prefill))
    step = SchedulerOutput(
        [
            ScheduledSequence("r", [11], len(p), t, window_block_ids=w)
            for p, t, w in zip(prompts, tables, windows, strict=True)
        ]
    )
    fused = runner.compute_logits(step)
    runner.model.fused_layers = None
    return fused, runner.compute_logits(step)


def reference_greedy_all(model_dir: Path, prompts: list[list[int]], count: int) -> list[list[int]]:
    """transformers' `count` greedy tokens after each prompt, float32, one model load."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    for prompt in prompts:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(count):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        out.append(tokens[len(prompt) :])
    return out


# ---- the checks every architecture's tests make (test_qwen3.py, test_smollm3.py, ...) ----

NEW_TOKENS = 32
_SHARED = [(13 * j) % 4000 + 300 for j in range(40)]
# The second shares the first's two full 16-token blocks: run after it, it starts from them.
PROMPTS = [_SHARED, [*_SHARED[:32], 77, 5001, 9, 12000], [400, 401, 402, 403, 404]]
ENGINE = {"dtype": "float32", "kv_cache_space_gib": 0.05}


def assert_logits_match_transformers(model_dir: Path, fused: bool) -> None:
    """Prefill, then five decode steps, of two sequences in scattered non-contiguous blocks:
    logits within 1e-4 of transformers' in float32, through the C++ decoder stack (`fused`,
    where this machine builds it) or the modules."""
    import transformers

    from rankcast.model.loader import load_model
    from rankcast.model_files.arch import ArchConfig
    from rankcast.protocol import ScheduledSequence, SchedulerOutput
    from rankcast.worker.model_runner import ModelRunner

    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, arch, 8, torch.device("cpu"), torch.float32)
    runner.initialize_cache(64)
    assert (runner.model.fused_layers is not None) == stack_expected(torch.float32)
    if not fused:
        runner.model.fused_layers = None
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    blocks = [[9, 2, 30, 4, 17, 50], [0, 11]]
    sequences = [list(PROMPTS[0]), list(PROMPTS[2])]

    def ours(prefill: bool) -> torch.Tensor:
        steps = [
            ScheduledSequence("r", s, 0, t)
            if prefill
            else ScheduledSequence("r", s[-1:], len(s) - 1, t)
            for s, t in zip(sequences, blocks, strict=True)
        ]
        return runner.compute_logits(SchedulerOutput(steps))

    def theirs() -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([theirs_model(torch.tensor([s])).logits[0, -1] for s in sequences])

    torch.testing.assert_close(ours(True), want := theirs(), atol=1e-4, rtol=0)
    for _ in range(5):
        for seq, row in zip(sequences, want, strict=True):
            seq.append(int(row.argmax()))
        torch.testing.assert_close(ours(False), want := theirs(), atol=1e-4, rtol=0)


def assert_greedy_whole_chunked_and_cached(model_dir: Path, reference: list[list[int]]) -> None:
    """32 greedy tokens equal transformers' (`reference`) with prompts whole, then in 16-token
    chunks with the prefix cache on: one at a time (the second prompt starts from the first's
    blocks), and all again (every full block a hit), the same tokens each time."""
    from rankcast import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(model_dir), enable_chunked_prefill=False, enable_prefix_caching=False, **ENGINE
    ) as llm:
        whole = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert whole == reference
    with LLM(str(model_dir), max_num_batched_tokens=16, max_num_seqs=4, **ENGINE) as llm:
        for _ in range(2):
            got = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in PROMPTS]
            assert got == reference
        hits = llm.engine.client.core.scheduler.stats().prefix_cache_hits
    # The second prompt's two shared blocks on the first pass, every prompt's full blocks short
    # of its last token on the second.
    assert hits >= 32 + 32 + 32, hits


def assert_gguf_converts_to_the_checkpoint(gguf_path: Path, model_dir: Path) -> Path:
    """A llama.cpp-style GGUF converts to the checkpoint's very tensors; the converted dir."""
    from safetensors.torch import load_file

    from rankcast.model_files.source import resolve_model

    converted = resolve_model(str(gguf_path)).model_dir
    ours = load_file(str(converted / "model.safetensors"))
    theirs = load_file(str(model_dir / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    return converted


def assert_served_at_tp2(
    model: Path,
    tokenizer_dir: Path,
    reference: list[list[int]],
    then: Callable[[Any], None] | None = None,
) -> None:
    """`rankcast serve MODEL --tensor-parallel-size 2` with a Python and a Rust API server: each
    server answers transformers' greedy tokens, whole and streamed. `then`: more checks of the
    fleet (given the `ServerProcess`) after those requests, while it still runs."""
    import json as json_module
    import time

    import httpx

    from rankcast.tokenizer import load_tokenizer
    from tests.entrypoints.server_process import ServerProcess
    from tests.frontend_rust.rust_fleet import frontend_env

    tokenizer = load_tokenizer(tokenizer_dir)
    server = ServerProcess(
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-space",
        "0.05",
        "--tensor-parallel-size",
        "2",
        api_server_count=1,
        rust_api_server_count=1,
        env=frontend_env(),
    )

    def answer(body: dict[str, Any]) -> tuple[str, str]:
        """(the answering server, the text), on a fresh connection."""
        url = f"{server.url}/v1/completions"
        if not body.get("stream"):
            reply = httpx.post(url, json=body, timeout=60)
            data = reply.json()
            assert data["usage"]["completion_tokens"] == NEW_TOKENS
            return reply.headers["x-rankcast-api-server"], data["choices"][0]["text"]
        text = ""
        with httpx.stream("POST", url, json=body, timeout=60) as reply:
            who = reply.headers["x-rankcast-api-server"]
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    text += json_module.loads(line[6:])["choices"][0]["text"]
        return who, text

    def both_servers(prompt: list[int], stream: bool) -> dict[str, str]:
        """The text each server (the Python one, "0", and the Rust one, "1") answers."""
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        body.update(ignore_eos=True, stream=stream)
        answered: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while set(answered) != {"0", "1"}:
            assert time.monotonic() < deadline, f"answered only by {sorted(answered)}"
            who, text = answer(body)
            answered[who] = text
        return answered

    from concurrent.futures import ThreadPoolExecutor

    # Every prompt, whole and streamed, at once: the engine batches them (each answer must
    # still be the one transformers gives the prompt alone: the batch-invariance rule), and
    # the check takes a few batched steps instead of one request's steps after another's.
    cases = [(p, w, s) for p, w in zip(PROMPTS, reference, strict=True) for s in (False, True)]
    with server.running(), ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: both_servers(case[0], case[2]), cases))
        for (_, want, stream), answered in zip(cases, answers, strict=True):
            expected = tokenizer.decode(want, skip_special_tokens=True)
            assert answered == {"0": expected, "1": expected}, (stream, answered)
        if then is not None:
            then(server)


def assert_peft_adapter_matches(
    model_dir: Path, adapter: Path, target_modules: list[str], prompt: list[int]
) -> None:
    """An adapter peft makes for the architecture (B not zero, so its delta shows) generates
    what transformers with peft generates, at TP=1 and TP=2."""
    import peft
    import transformers

    from rankcast import LLM, LoRARequest, SamplingParams
    from tests.conftest import reference_greedy

    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=target_modules,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft.get_peft_model(base, config).save_pretrained(str(adapter))
    want = reference_greedy(model_dir, prompt, 16, adapter)
    assert want != reference_greedy(model_dir, prompt, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = {"dtype": "float32", "kv_cache_space_gib": 0.05, "enable_lora": True}
    for tp in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=tp, max_lora_rank=8, **options) as llm:
            request = LoRARequest(adapter.name, str(adapter))
            out = llm.generate([prompt], greedy, lora_request=request)
        assert list(out[0].outputs[0].token_ids) == want, tp
