"""Turn a GGUF file into an HF-format directory (config.json, safetensors, tokenizer files).

Every tensor is dequantized to float32 with the `gguf` package; the result is written once to a
cache directory keyed by the source file's identity, so a second start only maps safetensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankcast import envs
from rankcast.errors import ModelFormatError
from rankcast.model_files.stored_head import STORED_HEAD_FILE, STORED_HEAD_TENSOR
from rankcast.process import abandoned_staging, staging_name

if TYPE_CHECKING:
    # Imported where a conversion runs: a warm start only checks the cache, and the launcher
    # and API servers that resolve the model never load torch for it.
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

# Bump when the conversion's output changes, so stale caches are not reused. 2: each conversion
# records its source (pruning); 3: config.json names head_dim (a llama file whose heads are not
# hidden / heads wide converted to a config that could not load). (qwen3moe files, added later,
# convert with the others unchanged.) 4: a Q6_K LM head is also kept as stored
# (rankcast/model_files/stored_head.py).
CONVERTER_VERSION = 4
# In each conversion's directory: `source_identity` of the GGUF it was made from.
_SOURCE_FILE = "rankcast-source.txt"
# In each conversion's directory: the GGUF's `native_quantization`, so that a start from the
# cache does not parse the file's metadata again for it (the embedded model's 49k-token
# vocabulary: ~1.2 s of every warm start on a Zen 4).
_QUANTIZATION_FILE = "rankcast-native-quantization.txt"

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Architectures whose Q and K rows llama.cpp's converter interleaves for its GGML_ROPE_TYPE_NORM
# rotation (its LlamaModel and subclasses); Qwen2's and Qwen3's rotate as HF does (NEOX), as
# stored.
_PERMUTED_QK = ("llama", "smollm3")
# llama.cpp stores no key for SmolLM3's layers without RoPE: its loader hardcodes every 4th
# (`n_no_rope_layer_step = 4`, layer i without when (i + 1) % 4 == 0), SmolLM3Config's default.
_SMOLLM3_NO_ROPE_INTERVAL = 4

# Phi-3 (llama.cpp's Phi3MiniModel writes the checkpoint's tensors as they are): q, k and v fused in
# `attn_qkv`, and `ffn_up` holding gate_up_proj, gate and up rows both (there is no ffn_gate);
# the model splits them at load. Its LongRoPE factors are the tensors `rope_factors_short` and
# `rope_factors_long`, which go to config.json's rope_scaling.
_PHI3_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ROPE_FACTORS = {"rope_factors_short": "short_factor", "rope_factors_long": "long_factor"}

# Gemma 3 (llama.cpp's Gemma3Model): four norms a block, `ffn_norm` being the one before the MLP
# (Llama's is its post_attention_layernorm), and every norm weight stored with Gemma's 1 added
# (its `norm_shift`), which the conversion takes off again. llama.cpp keeps no key for the
# local layers: with a sliding window, every 6th layer is global (`set_swa_pattern(6)`), the
# local ones rotate with base 10,000, and the attention scale is head_dim ** -0.5 except on the
# 27B (62 layers: (hidden / heads) ** -0.5).
_GEMMA3_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_NORM_SHIFT = 1.0
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Qwen3-MoE (llama.cpp's Qwen3MoeModel): the router `ffn_gate_inp` (kept float32), and each
# projection's experts stacked in one tensor, [experts, rows, columns], which the conversion
# cuts into the checkpoint's one tensor per expert. llama.cpp renormalises the chosen experts'
# weights for qwen3moe whatever the checkpoint said (`build_moe_ffn(..., norm_w = true, ...)`)
# and makes every layer sparse; the file has no key for either.
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def source_identity(path: Path) -> str:
    """A source file as the file system knows it: where it is, its size and modification
    time (a reinstalled or edited file is another source)."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"


def cache_key(path: Path) -> str:
    return hashlib.sha256(source_identity(path).encode()).hexdigest()[:16]


def cached_model_dir(path: Path) -> Path:
    return envs.cache_dir() / "gguf" / f"{path.stem}-{cache_key(path)}"


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) of a file of `arch` to its HF name, or
    None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, kind = base.split(".", 2)
        if arch == "phi3" and kind in _PHI3_TENSORS:
            return f"model.layers.{index}.{_PHI3_TENSORS[kind]}.{suffix}"
        if arch == "gemma3" and kind in _GEMMA3_TENSORS:
            return f"model.layers.{index}.{_GEMMA3_TENSORS[kind]}.{suffix}"
        if kind in _LAYER_TENSORS:
            return f"model.layers.{index}.{_LAYER_TENSORS[kind]}.{suffix}"
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    return None


def _expert_projection(gguf_name: str) -> tuple[str, str] | None:
    """(layer, projection) of a stacked experts tensor (`blk.3.ffn_up_exps.weight`), or None."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_TENSORS:
        return parts[1], _EXPERT_TENSORS[parts[2]]
    return None


def undo_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's interleaving of Q/K rows back to HF's rotate-half layout."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(rows, *rest)
    )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _read_config(reader: Any, path: Path, tensor_names: set[str]) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    heads = int(meta("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": int(meta("embedding_length")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    # Written always, as llama.cpp reads it: key_length where the file has it (Qwen3's head_dim
    # is not hidden / heads: 0.6B's 1024 / 16 heads of 128), hidden / heads where not.
    key_length = int(meta("attention.key_length", config["hidden_size"] // heads))
    value_length = int(meta("attention.value_length", key_length))
    if value_length != key_length:
        raise ModelFormatError(
            f"{path}: GGUF metadata {arch}.attention.value_length ({value_length}) differs "
            f"from {arch}.attention.key_length ({key_length}), which is not supported"
        )
    config["head_dim"] = key_length
    if arch == "smollm3":
        config["no_rope_layer_interval"] = _SMOLLM3_NO_ROPE_INTERVAL
    if arch == "phi3":
        _read_phi3_config(reader, path, config)
    if arch == "gemma3":
        _read_gemma3_config(reader, config)
    if arch == "qwen3moe":
        config["num_experts"] = int(meta("expert_count"))
        config["num_experts_per_tok"] = int(meta("expert_used_count"))
        config["moe_intermediate_size"] = int(meta("expert_feed_forward_length"))
        config["norm_topk_prob"] = True
        config["model_type"] = "qwen3_moe"
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none" and "rope_scaling" not in config:
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        }
    return config


def _read_gemma3_config(reader: Any, config: dict[str, Any]) -> None:
    """What llama.cpp's Gemma3Model writes of a Gemma3TextConfig, and what its loader assumes
    (`_GEMMA3_*` above): the window (`gemma3.attention.sliding_window`; none: every layer
    global), the local layers' base, the attention scale, the logit soft-cap where set."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    config["model_type"] = "gemma3_text"
    config["hidden_activation"] = "gelu_pytorch_tanh"
    window = int(_field(reader, "gemma3.attention.sliding_window", 0))
    config["sliding_window"] = window if window > 0 else None
    config["layer_types"] = [
        "sliding_attention" if window > 0 and (i + 1) % _GEMMA3_SWA_PATTERN else "full_attention"
        for i in range(layers)
    ]
    config["rope_local_base_freq"] = _GEMMA3_LOCAL_THETA
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // heads if layers == _GEMMA3_27B_LAYERS else config["head_dim"]
    )
    cap = _field(reader, "gemma3.final_logit_softcapping")
    config["final_logit_softcapping"] = float(cap) if cap is not None else None


def _read_phi3_config(reader: Any, path: Path, config: dict[str, Any]) -> None:
    """What llama.cpp's converter writes of a Phi3Config: the rotated width
    (`phi3.rope.dimension_count`, int(partial_rotary_factor * hidden) // heads), the original
    context (`phi3.rope.scaling.original_context_length`), the window (`phi3.attention.
    sliding_window`, 0 for none), and with LongRoPE its factors as two tensors and the
    attention factor it computed (`phi3.rope.scaling.attn_factor`)."""
    head_dim = config["head_dim"]
    rotary = int(_field(reader, "phi3.rope.dimension_count", head_dim))
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary:  # read back as transformers does: int(head_dim * f)
        factor = math.nextafter(factor, math.inf)
    config["partial_rotary_factor"] = factor
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    window = int(_field(reader, "phi3.attention.sliding_window", 0))
    config["sliding_window"] = window if window > 0 else None
    factors = {}
    for tensor in reader.tensors:
        if tensor.name.removesuffix(".weight") in _ROPE_FACTORS:
            key = _ROPE_FACTORS[tensor.name.removesuffix(".weight")]
            factors[key] = [float(x) for x in tensor.data.reshape(-1)]
    if not factors:
        return
    if len(factors) != 2 or original is None:
        raise ModelFormatError(
            f"{path}: a phi3 GGUF with LongRoPE needs rope_factors_short, rope_factors_long "
            "and phi3.rope.scaling.original_context_length"
        )
    config["rope_scaling"] = {"rope_type": "longrope", **factors}
    attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
    if attn_factor is not None:
        config["rope_scaling"]["attention_factor"] = float(attn_factor)


def _dequantize(
    reader: Any, path: Path, arch: str, heads: dict[str, int]
) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(
        reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=envs.disable_progress()
    ):
        expert = _expert_projection(tensor.name)
        name = hf_tensor_name(tensor.name, arch)
        if name is None and expert is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelFormatError(
                f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if expert is not None:
            layer, projection = expert
            for index, part in enumerate(array):
                hf_name = f"model.layers.{layer}.mlp.experts.{index}.{projection}.weight"
                tensors[hf_name] = torch.from_numpy(np.array(part, dtype=np.float32, order="C"))
            continue
        assert name is not None
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array - np.float32(_GEMMA3_NORM_SHIFT)
        permuted = arch in _PERMUTED_QK
        if permuted and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = undo_rope_permute(array, heads["q"])
        elif permuted and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = undo_rope_permute(array, heads["kv"])
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return tensors


def _q6_k_head(reader: Any) -> torch.Tensor | None:
    """The LM head's blocks as stored (uint8 [vocab, hidden / 256 * 210]) where the file keeps
    it as Q6_K: its `output` tensor, or the embedding a tied head reads. None otherwise."""
    import numpy as np
    import torch

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if head is None or head.tensor_type.name != "Q6_K":
        return None
    rows = int(head.shape[-1])  # GGUF shapes list the fastest-varying dimension first
    return torch.from_numpy(np.array(head.data, dtype=np.uint8).reshape(rows, -1))


class _NumpyWithPlainMemmap:
    """numpy, except that `memmap` gives a plain ndarray view of the mapping.

    `gguf.GGUFReader` parses every metadata field by slicing its `np.memmap`, and each slice
    of a memmap runs memmap's Python-level `__getitem__` and `__array_finalize__`: with a 49k
    token vocabulary and its merges, over half of the parse (4.7 -> 2.0 s on the 2-core Zen 3,
    the same fields and tensors). A view of the same mapping slices like any array and keeps
    the mapping alive through its base.
    """

    def __getattr__(self, name: str) -> Any:
        import numpy

        # Kept on the instance: the parse looks up `np.uint32` and the like per element
        # (~1.8M times for the embedded vocabulary), and only a miss comes here.
        value = getattr(numpy, name)
        setattr(self, name, value)
        return value

    @staticmethod
    def memmap(*args: Any, **kwargs: Any) -> Any:
        import numpy

        return numpy.memmap(*args, **kwargs).view(numpy.ndarray)


@contextlib.contextmanager
def _fast_gguf_parsing() -> Iterator[None]:
    """GGUFReaders made inside (ours, or transformers' in the tokenizer's process) parse over a
    plain array. Only the `np` name inside gguf's reader module is swapped, and only here."""
    import gguf.gguf_reader as reader_module

    saved = getattr(reader_module, "np")  # noqa: B009 (not a name gguf exports)
    setattr(reader_module, "np", _NumpyWithPlainMemmap())  # noqa: B010
    try:
        yield
    finally:
        setattr(reader_module, "np", saved)  # noqa: B010


def _write_tokenizer(path: Path, out_dir: Path) -> None:
    """Rebuild the tokenizer and chat template from GGUF metadata via transformers' converter."""
    try:
        tokenizer = _tokenizer_from_gguf_metadata(path)
    except Exception as exc:
        raise ModelFormatError(f"{path}: tokenizer metadata cannot be read ({exc})") from None
    tokenizer.save_pretrained(str(out_dir))


def _tokenizer_from_gguf_metadata(path: Path) -> Any:
    """transformers' tokenizer for the GGUF, built straight from the tokenizer metadata where
    transformers exposes its GGUF converter (5.x), else through `AutoTokenizer`.

    `AutoTokenizer.from_pretrained(gguf_file=...)` first builds the model's configuration from
    the GGUF: that imports transformers' modelling stack and parses every field of the file
    with gguf's reader (the 49k-token vocabulary and its merges twice over): 8.6 s on the
    2-core Zen 3, against ~4-5 s for its converter called directly, which reads only the
    tokenizer's fields and writes the same `tokenizer.json` and chat template
    (tests/model/test_gguf.py compares the two)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        return _tokenizer_via_auto(path)
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    fast: Callable[..., Any] = PreTrainedTokenizerFast  # its __init__ is unannotated
    return fast(tokenizer_object=backend, **tokenizer_config, **extra)


def _tokenizer_via_auto(path: Path) -> Any:
    """The same tokenizer the long way (transformers without the direct converter)."""
    from transformers import AutoTokenizer

    with _fast_gguf_parsing():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


class _TokenizerWriter:
    """`_write_tokenizer` in a process of its own (`python -m rankcast.model_files.gguf_convert`).

    transformers' converter imports transformers and reads the GGUF's tokenizer fields again;
    run beside the dequantization it takes the other core (cold start on a 2-core Zen 3:
    ~22 s -> ~15 s when it still went through `AutoTokenizer`). A plain subprocess, not
    multiprocessing: a user's script without a `__main__` guard must not be run again."""

    def __init__(self, path: Path, out_dir: Path) -> None:
        self.path = path
        # Kept open while the child runs (closed in close()); a file, not a pipe nobody reads.
        self.errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        command = [sys.executable, "-m", __name__, str(path), str(out_dir)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.errors
        )

    def wait(self) -> None:
        """Until the files are written; ModelFormatError with the child's last line if not."""
        if self.process.wait() == 0:
            return
        self.errors.seek(0)
        last = (self.errors.read().strip().splitlines() or ["no message"])[-1]
        if last.startswith(str(self.path)):  # the child's own ModelFormatError
            raise ModelFormatError(last)
        raise ModelFormatError(f"{self.path}: tokenizer metadata cannot be read ({last})")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.errors.close()


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise ModelFormatError(f"{path}: model file not found")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")


def open_gguf(path: Path) -> Any:
    """Open a GGUF file, turning the library's low-level failures into a message naming it."""
    from gguf import GGUFReader

    _check_magic(path)
    try:
        with _fast_gguf_parsing():
            return GGUFReader(str(path))
    except Exception as exc:
        raise ModelFormatError(
            f"{path}: GGUF file is truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from None


# The decoder layers' projections in a GGUF file's names: what `native_quantization` looks at.
_PROJECTIONS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    *_EXPERT_TENSORS,
)
# GGUF tensor types rankcast multiplies as they are stored (`--quantization` of the same name).
_NATIVE = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
_RECORDABLE = {"none", *_NATIVE.values()}  # what `native_quantization` can answer
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def native_quantization(path: Path) -> str:
    """The `--quantization` that serves a GGUF file's own weights: "q4_1" where every decoder
    projection is stored as Q4_1 (the embedded SmolLM2), "q4_0" / "q8_0" where every one is
    Q4_0 / Q8_0; "q8_0" too for any other file whose projections are all quantized (the
    K-quant mixes, Q5_0, Q5_1, Q6_K, ...: its Q8_0, Q5_0 and Q4_0 tensors keep their exact
    values, `quantize_q8_0_weight`, and the others are rounded to 8 bits, finer than their
    own 4 to 6, docs/quantization.md); "none" where any projection is float (its converted
    weights, in the engine's dtype)."""
    return _quantization_of(open_gguf(path))


def _quantization_of(reader: Any) -> str:
    """`native_quantization` of an open GGUF file."""
    types = {
        tensor.tensor_type.name
        for tensor in reader.tensors
        if tensor.name.startswith("blk.") and tensor.name.split(".")[-2] in _PROJECTIONS
    }
    if not types or types & _FLOAT_TYPES:
        return "none"
    return _NATIVE[types.pop()] if len(types) == 1 and types <= _NATIVE.keys() else "q8_0"


def converted_gguf(path: Path) -> tuple[Path, str]:
    """`path`'s HF-format directory (`convert_gguf`) and its `native_quantization`, read from
    the conversion where it was recorded; a conversion from before the record gets it now."""
    out_dir = convert_gguf(path)
    record = out_dir / _QUANTIZATION_FILE
    with contextlib.suppress(OSError):
        recorded = record.read_text()
        if recorded in _RECORDABLE:  # anything else (a torn write, an edit) is made again
            return out_dir, recorded
    quantization = native_quantization(path)
    with contextlib.suppress(OSError):  # a read-only cache still serves: it is only slower
        partial = out_dir / f".{_QUANTIZATION_FILE}.{os.getpid()}"
        partial.write_text(quantization)
        os.replace(partial, record)
    return out_dir, quantization


def convert_gguf(path: Path) -> Path:
    """Return an HF-format directory for `path`, converting it on first use."""
    out_dir = cached_model_dir(path)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    _check_magic(path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prune_stale_conversions(out_dir.parent)
    staging = Path(tempfile.mkdtemp(prefix=staging_name(""), dir=out_dir.parent))
    # Started first: the tokenizer's process takes as long as everything below.
    tokenizer = _TokenizerWriter(path, staging)
    try:
        reader = open_gguf(path)
        tensor_names = {t.name for t in reader.tensors}
        config = _read_config(reader, path, tensor_names)
        arch = _field(reader, "general.architecture")
        heads = {"q": config["num_attention_heads"], "kv": config["num_key_value_heads"]}
        logger.info("converting %s to float32 safetensors in %s (once)", path, out_dir)
        tensors = _dequantize(reader, path, arch, heads)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / _SOURCE_FILE).write_text(source_identity(path))
        (staging / _QUANTIZATION_FILE).write_text(_quantization_of(reader))
        from safetensors.torch import save_file

        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        head = _q6_k_head(reader)
        if head is not None:
            save_file({STORED_HEAD_TENSOR: head}, str(staging / STORED_HEAD_FILE))
        tokenizer.wait()
        try:
            os.rename(staging, out_dir)
        except OSError:
            # Another process finished the same conversion first; its result is as good.
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        tokenizer.close()
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def prune_stale_conversions(directory: Path) -> list[Path]:
    """Remove the conversions no start can use any more, and staging directories of
    conversions that died; return what was removed. Run before each conversion (a cold start).

    A conversion is keyed by its source's identity, so every reinstall of a model package
    (every fresh clone's virtual environment, for the embedded GGUF) converts again into a
    directory of its own, ~540 MB for SmolLM2-135M: without pruning they pile up. One whose
    source file is gone or changed is removed, as is one that does not say what its source
    was (written before conversions recorded it)."""
    removed = []
    for entry in directory.iterdir():
        if not entry.is_dir():
            continue
        abandoned = abandoned_staging(entry.name)
        if abandoned if abandoned is not None else _conversion_is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _conversion_is_stale(entry: Path) -> bool:
    try:
        recorded = (entry / _SOURCE_FILE).read_text()
        source = Path(recorded.rsplit("|", 3)[0])
        return source_identity(source) != recorded
    except OSError:  # no record, or its source is gone
        return True


if __name__ == "__main__":
    # `_TokenizerWriter`'s child: GGUF path, output directory.
    try:
        _write_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
    except ModelFormatError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
