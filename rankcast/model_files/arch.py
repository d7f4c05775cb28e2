"""The architecture description of a Llama-family checkpoint, read from its config.json.

Beside Llama itself the family covers what differs from it by a switch the decoder takes:
Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm (`qk_norm`) and explicit `head_dim`, SmolLM3's
layers without RoPE (`rope_layers`), Phi-3's partial rotary (`rotary_dim`) and LongRoPE (its
`rope_scaling`, normalised here: `_longrope`). A config asking for what the decoder does not do (a
sliding window, an MLP bias) is refused at start, naming the field, rather than served wrongly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankcast.errors import ModelFormatError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Phi3ForCausalLM",
)

# What a config.json may leave out, filled as transformers' config class of the architecture
# fills it (Qwen3Config's head_dim is 128 whatever the hidden size; SmolLM3Config's RoPE base is
# 2e6 and its embeddings tied), so a sparse config means what it means to the reference.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "SmolLM3ForCausalLM": {"tie_word_embeddings": True},
    "Phi3ForCausalLM": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
}
_DEFAULT_THETA = {"SmolLM3ForCausalLM": 2000000.0}
# Architectures whose o_proj has a bias wherever their q/k/v projections do (`attention_bias`);
# Qwen2's and Mistral's never has one.
_OUTPUT_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")


@dataclass(frozen=True)
class ArchConfig:
    """Everything the decoder needs to know about its shape.

    Kept separate from transformers' config classes so workers depend on plain data only.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections
    output_bias: bool  # o_proj (Llama-style checkpoints with attention_bias)
    # Qwen3: an RMSNorm over each query and each key head (`self_attn.q_norm`, `k_norm`, weights
    # of head_dim), applied before RoPE.
    qk_norm: bool
    # Per layer, whether its attention rotates q and k (SmolLM3 leaves every 4th layer without).
    rope_layers: tuple[bool, ...]
    # How many of each head's head_dim values RoPE rotates, the first ones (Phi-3's
    # partial_rotary_factor: 0.75 of 128 = 96); the rest pass through. head_dim elsewhere.
    rotary_dim: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
        """Read an HF config dict, rejecting what the decoder cannot run with a clear message."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"{source}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        cfg = {**_DEFAULTS.get(arch, {}), **cfg}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            theta = cfg.get("rope_theta")
            if theta is None and isinstance(rope, dict):
                theta = rope.get("rope_theta")
            given_rope = rope
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "default":
                rope = None
            _refuse_unsupported(cfg, arch, source)
            attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            max_positions = int(cfg.get("max_position_embeddings", 2048))
            rotary_dim = head_dim
            if arch == "Phi3ForCausalLM":
                rotary_dim = _rotary_dim(cfg, given_rope, head_dim, source)
                rope = _longrope(cfg, rope, rotary_dim, max_positions, source)
                attention_bias = False  # Phi3Attention's projections never have one
                max_positions = _windowed_context(cfg, max_positions, source)
            elif arch == "MistralForCausalLM" or (
                arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window")
            ):
                # Their config classes apply the window (Mistral whenever it is set, Qwen2
                # only with use_sliding_window): capped like Phi-3's, never ignored.
                max_positions = _windowed_context(cfg, max_positions, source)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta if theta is not None else _DEFAULT_THETA.get(arch, 1e4)),
                rope_scaling=dict(rope) if isinstance(rope, dict) else None,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                output_bias=attention_bias and arch in _OUTPUT_BIAS,
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_layers=(
                    _rope_layers(cfg, layers, source)
                    if arch == "SmolLM3ForCausalLM"
                    else (True,) * layers
                ),
                rotary_dim=rotary_dim,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ModelFormatError(f"{source}: required field {exc.args[0]!r} is missing") from None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ArchConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelFormatError(f"{path}: not found (a model directory needs config.json)")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{path}: cannot be read as JSON ({exc})") from None
        arch = cls.from_dict(data, source=str(path))
        generation = model_dir / "generation_config.json"
        if generation.is_file():
            # Chat checkpoints often list extra end-of-turn ids only here (Llama 3 does).
            try:
                eos = json.loads(generation.read_text()).get("eos_token_id")
            except (OSError, json.JSONDecodeError):
                eos = None
            extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
            merged = tuple(dict.fromkeys([*arch.eos_token_ids, *extra]))
            arch = dataclasses.replace(arch, eos_token_ids=merged)
        return arch


def _refuse_unsupported(cfg: dict[str, Any], arch: str, source: str) -> None:
    """Refuse what the decoder would otherwise ignore and serve wrongly, naming the field."""
    if cfg.get("mlp_bias"):
        raise ModelFormatError(f"{source}: mlp_bias = true is not supported (no MLP biases)")
    # Their config classes apply a window only with both set. (Qwen2's and Mistral's windows
    # cap the context: `_windowed_context`.)
    if arch == "Phi3ForCausalLM" and cfg.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(
            f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (the MLP is SiLU's)"
        )
    windowed = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    if arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM") and windowed:
        raise ModelFormatError(
            f"{source}: use_sliding_window = true is not supported (every layer attends "
            "to the whole context here)"
        )


def _rope_layers(cfg: dict[str, Any], layers: int, source: str) -> tuple[bool, ...]:
    """SmolLM3's per-layer RoPE switch: `no_rope_layers` (despite the name, 1 where the layer
    uses RoPE, 0 where it does not), or when absent every `no_rope_layer_interval`-th layer
    without (layer i rotates unless (i + 1) % interval == 0), as SmolLM3Config derives it."""
    given = cfg.get("no_rope_layers")
    if given is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ModelFormatError(
                f"{source}: no_rope_layer_interval must be a positive integer, not {interval!r}"
            )
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if (
        not isinstance(given, list)
        or len(given) != layers
        or any(flag not in (0, 1) or isinstance(flag, float) for flag in given)
    ):
        raise ModelFormatError(
            f"{source}: no_rope_layers must list 0 or 1 for each of the {layers} layers "
            f"(1: the layer uses RoPE), not {given!r}"
        )
    return tuple(bool(flag) for flag in given)


def _rotary_dim(cfg: dict[str, Any], rope: Any, head_dim: int, source: str) -> int:
    """Phi-3's rotated width: int(head_dim * partial_rotary_factor), as transformers computes
    it, the factor read from the RoPE parameters or the top level (where Phi-4-mini's
    config.json has it). Refused unless it leaves an even number of dims in (0, head_dim]."""
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is None:
        factor = cfg.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ModelFormatError(f"{source}: partial_rotary_factor must be a number, not {factor!r}")
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelFormatError(
            f"{source}: partial_rotary_factor {factor} rotates {rotary_dim} of the {head_dim} "
            "dims of a head; it must be an even number from 2 to head_dim"
        )
    return rotary_dim


def _longrope(
    cfg: dict[str, Any], rope: Any, rotary_dim: int, max_positions: int, source: str
) -> dict[str, Any] | None:
    """Phi-3's RoPE scaling, normalised for rankcast/model/rotary.py: None (plain RoPE) or
    {"rope_type": "longrope", short_factor, long_factor, original_max_position_embeddings,
    attention_factor}. As Phi3Config reads it: "su" and "yarn" are old names of longrope, the
    original length comes from the top level first, and each factor list has rotary_dim / 2
    numbers. The attention factor is transformers' `_compute_longrope_parameters`: the one given,
    else sqrt(1 + ln(s) / ln(original)) with s = max_position_embeddings / original (1 where
    s <= 1); it scales the rotated dims' cos and sin at every length."""
    if not isinstance(rope, dict):
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("longrope", "su", "yarn"):
        raise ModelFormatError(
            f"{source}: rope_scaling type {kind!r} is not supported for Phi3ForCausalLM "
            "(longrope or none)"
        )
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = rope.get("original_max_position_embeddings", max_positions)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelFormatError(
            f"{source}: original_max_position_embeddings must be a positive integer, "
            f"not {original!r}"
        )
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if (
            not isinstance(value, list)
            or len(value) != rotary_dim // 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        ):
            raise ModelFormatError(
                f"{source}: rope_scaling.{key} must list {rotary_dim // 2} numbers "
                f"(rotary_dim / 2), not {value!r}"
            )
        factors[key] = [float(x) for x in value]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        scale = rope.get("factor")
        if scale is None:
            scale = max_positions / original
        attention_factor = (
            1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def _windowed_context(cfg: dict[str, Any], max_positions: int, source: str) -> int:
    """The context under a `sliding_window` (Phi-3-mini-4k: 2047 of 4096; Mistral 7B v0.1:
    4096 of 32768; Qwen2 with `use_sliding_window`). Every layer
    here attends to the whole context, which is the window's attention exactly while a
    sequence is no longer than the window: so the context is capped at the window rather than
    the model refused (Phi-3.5 and Phi-4-mini set a window beyond their context: no cap)."""
    window = cfg.get("sliding_window")
    if window is None:
        return max_positions
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelFormatError(
            f"{source}: sliding_window must be a positive integer or null, not {window!r}"
        )
    return min(max_positions, int(window))
