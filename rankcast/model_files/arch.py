"""The architecture description of a Llama-family checkpoint, read from its config.json.

Beside Llama itself the family covers what differs from it by a switch the decoder takes:
Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm (`qk_norm`) and explicit `head_dim`, SmolLM3's
layers without RoPE (`rope_layers`), Phi-3's partial rotary (`rotary_dim`) and LongRoPE (its
`rope_scaling`, normalised here: `_longrope`), sliding windows per layer (`layer_windows`:
Mistral's, Qwen2's and Qwen3's with `use_sliding_window`, Phi-3's, Gemma 3's local layers), and
Gemma 3's block (`sandwich_norms`, norms scaling by 1 + w, scaled embeddings, GeGLU, its own
attention scale and a second RoPE base for local layers), and the mixtures of experts of
Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's): `moe_layers` and the experts' shape. A
config asking for what the decoder does not do (an MLP bias, attention logit soft-capping) is
refused at start, naming the field, rather than served wrongly.
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
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)

# What a config.json may leave out, filled as transformers' config class of the architecture
# fills it (Qwen3Config's head_dim is 128 whatever the hidden size; SmolLM3Config's RoPE base is
# 2e6 and its embeddings tied), so a sparse config means what it means to the reference.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    # Qwen3MoeConfig's: 128 experts of 768, 8 a token, not renormalised unless asked.
    "Qwen3MoeForCausalLM": {
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    # MixtralConfig's: 8 experts, 2 a token.
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "SmolLM3ForCausalLM": {"tie_word_embeddings": True},
    "Phi3ForCausalLM": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "Gemma3ForCausalLM": {
        "head_dim": 256,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}
_DEFAULT_THETA = {"SmolLM3ForCausalLM": 2000000.0, "Gemma3ForCausalLM": 1000000.0}
# Gemma3TextConfig's RoPE base for its sliding-window layers (`rope_local_base_freq`).
_GEMMA3_LOCAL_THETA = 10000.0
# The activations Gemma 3's MLP may name: the tanh approximation of GELU, under both names.
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# Architectures whose o_proj has a bias wherever their q/k/v projections do (`attention_bias`);
# Qwen2's and Mistral's never has one.
_OUTPUT_BIAS = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
)
# Architectures with the Qwen3 attention (per-head q/k norms); Mixtral's is Mistral's.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")


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
    # Qwen3, Gemma 3: an RMSNorm over each query and each key head (`self_attn.q_norm`,
    # `k_norm`, weights of head_dim), applied before RoPE.
    qk_norm: bool
    # Per layer, whether its attention rotates q and k (SmolLM3 leaves every 4th layer without).
    rope_layers: tuple[bool, ...]
    # How many of each head's head_dim values RoPE rotates, the first ones (Phi-3's
    # partial_rotary_factor: 0.75 of 128 = 96); the rest pass through. head_dim elsewhere.
    rotary_dim: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Per layer, its sliding window: a query sees the keys at most window - 1 positions back
    # (0: the whole context). Empty: no layer has one.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the RoPE base of its windowed layers (None: every layer uses rope_theta, which
    # with rope_scaling is then its global layers').
    local_rope_theta: float | None = None
    # Gemma 3's block: norms after attention and after the MLP too (post_attention_layernorm,
    # pre_feedforward_layernorm, post_feedforward_layernorm), each norm scaling by
    # (norm_weight_offset + w) in float32, embeddings multiplied by embedding_multiplier,
    # GeGLU ("gelu_tanh") instead of SwiGLU ("silu").
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    embedding_multiplier: float = 1.0
    hidden_activation: str = "silu"
    # The attention's softmax scale where it is not head_dim ** -0.5 (Gemma 3's
    # query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    # Gemma: logits = cap * tanh(logits / cap).
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): per layer, whether its MLP is the experts'
    # (empty: a dense model; Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step` leave some
    # layers dense, of intermediate_size); the experts, how many each token takes (the router's
    # top k of its softmax), each expert's width, and whether the k weights are renormalised to
    # sum to one (Qwen3-MoE's `norm_topk_prob`; Mixtral always does).
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for none."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def separate_window_group(self) -> bool:
        """Whether the windowed layers' caches form a KV-cache group of their own (group 1,
        engine_core/kv_cache_manager.py): the model has layers with and without a window."""
        return bool(self.layer_windows) and 0 in self.layer_windows

    def kv_group(self, layer: int) -> int:
        """The KV-cache group of layer `layer`'s cache: 1 for a windowed layer of a model that
        also has full ones, else 0."""
        return 1 if self.separate_window_group and self.window(layer) else 0

    def group_windows(self) -> tuple[int, ...]:
        """Each KV-cache group's window (what its blocks are handed back behind): the largest
        of its layers' (0: it keeps every block)."""
        if not self.layer_windows:
            return (0,)
        widest = max(self.layer_windows)
        return (0, widest) if self.separate_window_group else (widest,)

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
            if arch == "MixtralForCausalLM":
                attention_bias = False  # MixtralAttention's projections never have one
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            max_positions = int(cfg.get("max_position_embeddings", 2048))
            rotary_dim = head_dim
            gemma: dict[str, Any] = {}
            if arch == "Phi3ForCausalLM":
                rotary_dim = _rotary_dim(cfg, given_rope, head_dim, source)
                rope = _longrope(cfg, rope, rotary_dim, max_positions, source)
                attention_bias = False  # Phi3Attention's projections never have one
            elif arch == "Gemma3ForCausalLM":
                gemma, rope, theta = _gemma3(cfg, hidden, source)
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
                qk_norm=arch in _QK_NORM,
                rope_layers=(
                    _rope_layers(cfg, layers, source)
                    if arch == "SmolLM3ForCausalLM"
                    else (True,) * layers
                ),
                rotary_dim=rotary_dim,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                layer_windows=_layer_windows(cfg, arch, layers, max_positions, source),
                **gemma,
                **_experts(cfg, arch, layers, source),
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


def _experts(cfg: dict[str, Any], arch: str, layers: int, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ArchConfig, as Qwen3MoeConfig and MixtralConfig read
    their configs (transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`, the
    checkpoints on the hub as `num_experts`: both are read). Refused, naming the field, unless
    each token takes between 1 and all of the experts."""
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return {}
    if arch == "MixtralForCausalLM":
        experts, width, norm = cfg["num_local_experts"], cfg["intermediate_size"], True
        sparse = (True,) * layers
    else:
        experts = cfg.get("num_local_experts", cfg["num_experts"])
        width, norm = cfg["moe_intermediate_size"], bool(cfg["norm_topk_prob"])
        step = cfg.get("decoder_sparse_step", 1)
        dense = cfg.get("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ModelFormatError(
                f"{source}: decoder_sparse_step must be a positive integer, not {step!r}"
            )
        if not isinstance(dense, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense
        ):
            raise ModelFormatError(
                f"{source}: mlp_only_layers must list layer indices below {layers}, not {dense!r}"
            )
        # Qwen3MoeDecoderLayer's rule: experts where the layer is not listed dense, there are
        # experts, and (layer + 1) is a multiple of the step.
        sparse = tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
    per_token = cfg["num_experts_per_tok"]
    width_name = "intermediate_size" if arch == "MixtralForCausalLM" else "moe_intermediate_size"
    for name, value in (
        ("num_experts", experts),
        (width_name, width),
        ("num_experts_per_tok", per_token),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelFormatError(f"{source}: {name} must be a positive integer, not {value!r}")
    if per_token > experts:
        raise ModelFormatError(
            f"{source}: num_experts_per_tok ({per_token}) is more than the {experts} experts"
        )
    return {
        "moe_layers": sparse if any(sparse) else (),
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate_size": width,
        "norm_topk_prob": norm,
    }


def _refuse_unsupported(cfg: dict[str, Any], arch: str, source: str) -> None:
    """Refuse what the decoder would otherwise ignore and serve wrongly, naming the field."""
    if cfg.get("mlp_bias"):
        raise ModelFormatError(f"{source}: mlp_bias = true is not supported (no MLP biases)")
    if arch == "Phi3ForCausalLM" and cfg.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(
            f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (the MLP is SiLU's)"
        )
    # SmolLM3Config applies a window only with both set.
    windowed = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    if arch == "SmolLM3ForCausalLM" and windowed:
        raise ModelFormatError(
            f"{source}: use_sliding_window = true is not supported for SmolLM3 (every layer "
            "attends to the whole context here)"
        )
    if arch == "Gemma3ForCausalLM":
        if cfg.get("attn_logit_softcapping") is not None:
            raise ModelFormatError(
                f"{source}: attn_logit_softcapping is not supported (Gemma 3 has none; "
                "Gemma 2's checkpoints set it)"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ModelFormatError(
                f"{source}: use_bidirectional_attention = true is not supported (a decoder "
                "serves causal attention)"
            )
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in _GELU_TANH:
            raise ModelFormatError(
                f"{source}: hidden_activation {cfg['hidden_activation']!r} is not supported "
                f"(Gemma 3's MLP is GeGLU: {' or '.join(_GELU_TANH)})"
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


def _layer_windows(
    cfg: dict[str, Any], arch: str, layers: int, max_positions: int, source: str
) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), as each architecture's config class sets it:
    Mistral and Phi-3 window every layer when `sliding_window` is set; Qwen2 and Qwen3 only
    with `use_sliding_window`, the layers from `max_window_layers` on (or as `layer_types`
    says); Gemma 3 the layers `layer_types` calls "sliding_attention" (without it, all but
    every `sliding_window_pattern`-th, 6 by default). A window at least the context long
    (Phi-3.5's, Phi-4-mini's) is no window. Empty where no layer has one."""
    types = cfg.get("layer_types")
    kinds = ("sliding_attention", "full_attention")
    if types is not None and (
        not isinstance(types, list)
        or len(types) != layers
        or any(kind not in kinds for kind in types)
    ):
        raise ModelFormatError(
            f"{source}: layer_types must name each of the {layers} layers "
            f"sliding_attention or full_attention, not {types!r}"
        )
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get(
        "use_sliding_window"
    ):
        window = None
    if (
        arch
        not in (
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Phi3ForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Gemma3ForCausalLM",
        )
        or window is None
    ):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelFormatError(
            f"{source}: sliding_window must be a positive integer or null, not {window!r}"
        )
    if types is None:
        if arch == "Gemma3ForCausalLM":
            pattern = cfg.get("sliding_window_pattern", 6)
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ModelFormatError(
                    f"{source}: sliding_window_pattern must be a positive integer, not {pattern!r}"
                )
            types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)
            ]
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention"] * layers
    if window >= max_positions:
        return ()
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _gemma3(
    cfg: dict[str, Any], hidden: int, source: str
) -> tuple[dict[str, Any], dict[str, Any] | None, float]:
    """Gemma 3's switches (ArchConfig fields), its global layers' RoPE scaling and base. Its
    RoPE parameters come either as transformers 5 writes them (`rope_parameters` keyed by layer
    type, each with its `rope_theta`) or as older configs do (`rope_theta` and `rope_scaling`
    for the global layers, `rope_local_base_freq` for the local ones)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(cfg.get("rope_scaling") or params or {}), {}
    theta = full.pop("rope_theta", None) or cfg.get("rope_theta") or 1000000.0
    local_theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or _GEMMA3_LOCAL_THETA
    if local.get("rope_type", "default") != "default":
        raise ModelFormatError(
            f"{source}: rope_parameters.sliding_attention.rope_type "
            f"{local['rope_type']!r} is not supported (Gemma 3's local layers use plain RoPE)"
        )
    kind = full.get("rope_type", full.get("type", "default"))
    rope = None if kind == "default" else full
    scalar = cfg["query_pre_attn_scalar"]
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ModelFormatError(
            f"{source}: query_pre_attn_scalar must be a positive number, not {scalar!r}"
        )
    cap = cfg.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        raise ModelFormatError(
            f"{source}: final_logit_softcapping must be a positive number or null, not {cap!r}"
        )
    switches = {
        "local_rope_theta": float(local_theta),
        "sandwich_norms": True,
        "norm_weight_offset": 1.0,
        "embedding_multiplier": math.sqrt(hidden),
        "hidden_activation": "gelu_tanh",
        "attention_scale": float(scalar) ** -0.5,
        "final_logit_softcapping": float(cap) if cap is not None else None,
    }
    return switches, rope, float(theta)
