"""PEFT LoRA adapters: read what `peft`'s `save_pretrained` writes, validate it against the model,
(each projection cuts its own tensor-parallel shard: rankcast/lora/layers.py).

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`. Everything is
checked before anything is handed to the engine, so a bad adapter is an error that names the file
and the problem, and never a half-loaded one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rankcast.errors import ClientError
from rankcast.model.rotary import partial_rotary_order
from rankcast.model_files.arch import ArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target.
TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused projections, which its adapters target: one A shared by the parts, B's rows the
# parts' in order. Read as the parts (`_split_fused`), as the model loads its own weights.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


class LoRAAdapterError(ClientError):
    """An adapter cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's low-rank pair: delta(x) = scaling * B @ (A @ x)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]


@dataclass(frozen=True)
class SlotImage:
    """One LoRA layer's slot contents for one adapter: A of every sub-projection stacked
    [subs, max_rank, in], B transposed per sub-projection [max_rank, out]; zeros where the
    adapter's rank is smaller or it leaves a sub-projection alone (`targets` False)."""

    a: torch.Tensor
    b: list[torch.Tensor]
    targets: list[bool]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    scaling: float
    # (layer index, module name) -> weights; the module names are the checkpoint's (q_proj, ...).
    weights: dict[tuple[int, str], LoRAWeights]
    # What each LoRA layer of this rank copies into a slot (its shard, scaled, B transposed,
    # padded to the slot's rank), made by the rank as it reads the adapter, which then drops
    # `weights` (ModelRunner.host_tier_form); empty as read from the files. Adapters taking
    # turns for slots are activated again and again, and slicing, scaling and transposing
    # every projection each time was ~7 ms of Python per activation.
    slot_images: dict[tuple[int, Hashable], SlotImage] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


# The MLP's projections: on a mixture-of-experts layer they are the experts', which take no
# adapter.
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable projection, unsharded (with Phi-3's
    fused ones, for the architectures that have them)."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    fused = {"qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}
    return {
        **(fused if arch.architecture in _FUSED_ARCHITECTURES else {}),
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_allowed(path: Path, allowed_roots: list[Path] | None) -> Path:
    """The adapter's real path, if it lies under an allowed root (symlinks resolved first)."""
    if "\x00" in str(path):  # the OS refuses it with a bare ValueError (a 500, not a 400)
        raise LoRAAdapterError(f"{str(path)!r}: a path cannot contain a NUL byte")
    resolved = path.expanduser().resolve()
    if allowed_roots is None:
        return resolved
    for root in allowed_roots:
        if resolved.is_relative_to(root.expanduser().resolve()):
            return resolved
    roots = ", ".join(str(r) for r in allowed_roots) or "none configured"
    raise LoRAAdapterError(
        f"{path}: adapters may only be loaded from under the allowed roots ({roots}); "
        "see --allowed-lora-paths"
    )


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise LoRAAdapterError(f"{directory}: adapter directory does not exist")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"{config_path}: missing (not a PEFT adapter directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"{config_path}: unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: expected a JSON object")
    return config


def _check_config(
    config: dict[str, Any], config_path: Path, max_lora_rank: int
) -> tuple[int, float]:
    """The adapter's rank and scaling, after refusing what rankcast does not apply."""

    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{config_path}: {why}")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config.get('bias')!r} is not supported (only 'none')")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise refuse(f"{flag} is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(key):
            raise refuse(f"{key} is not supported")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or alpha <= 0:
        raise refuse(f"lora_alpha must be a positive number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """`...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` -> (i, module, A|B)."""
    parts = key.split(".")
    if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        return None
    try:
        layer = int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        return None
    return layer, parts[-3], parts[-2][-1]


@dataclass(frozen=True)
class AdapterMetadata:
    """What an adapter is, read from its config and the safetensors header alone: enough for the
    engine to accept or refuse it without reading its tensors (each rank reads those once)."""

    path: Path
    rank: int
    scaling: float
    nbytes: int  # as the ranks read it (float32; their slot images are their shard, padded)
    # Checkpoint key -> (layer, module, half "A" or "B").
    keys: dict[str, tuple[int, str, str]]


def inspect_peft_adapter(
    path: str | Path,
    arch: ArchConfig,
    max_lora_rank: int,
    allowed_roots: list[Path] | None = None,
) -> AdapterMetadata:
    """Check a PEFT LoRA adapter against the model from its config and tensor header; raises
    LoRAAdapterError naming the file and the problem."""
    from safetensors import SafetensorError, safe_open

    directory = check_allowed(Path(path), allowed_roots)
    config_path = directory / CONFIG_FILE
    rank, scaling = _check_config(_read_config(directory), config_path, max_lora_rank)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        hint = (
            " (adapter_model.bin is not read: save with safe_serialization)"
            if (directory / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAAdapterError(f"{weights_path}: missing{hint}")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = f.keys()  # safe_open is not iterable: keys() is its listing
            shapes_in_file = {key: tuple(f.get_slice(key).get_shape()) for key in names}
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"{weights_path}: unreadable: {exc}") from None

    shapes = module_shapes(arch)
    keys: dict[str, tuple[int, str, str]] = {}
    halves: dict[tuple[int, str], set[str]] = {}
    nbytes = 0
    for key, shape in shapes_in_file.items():
        parsed = _parse_key(key)
        if parsed is None:
            raise LoRAAdapterError(f"{weights_path}: unexpected tensor {key!r}")
        layer, module, half = parsed
        if module not in shapes:
            raise LoRAAdapterError(
                f"{weights_path}: {key!r} targets {module!r}; the model's targetable modules are "
                f"{', '.join(shapes)}"
            )
        if not 0 <= layer < arch.num_hidden_layers:
            raise LoRAAdapterError(
                f"{weights_path}: {key!r} is for layer {layer}; the model has "
                f"{arch.num_hidden_layers}"
            )
        if module in _MLP_MODULES and arch.is_moe(layer):
            raise LoRAAdapterError(
                f"{weights_path}: {key!r} adapts layer {layer}'s MLP, which is a mixture of "
                "experts here; adapters on experts are not supported (attention projections "
                "only)"
            )
        in_features, out_features = shapes[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if shape != want:
            raise LoRAAdapterError(
                f"{weights_path}: {key!r} has shape {shape}, expected {want} "
                f"(rank {rank}, {module} of this model)"
            )
        keys[key] = parsed
        halves.setdefault((layer, module), set()).add(half)
        # A fused projection's A is read once for each of its parts.
        nbytes += (
            4 * math.prod(shape) * (len(FUSED[module]) if module in FUSED and half == "A" else 1)
        )
    if not halves:
        raise LoRAAdapterError(f"{weights_path}: holds no LoRA tensors")
    for (layer, module), pair in sorted(halves.items()):
        if pair != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(
                f"{weights_path}: layer {layer} {module} has no {missing} weight"
            )
    return AdapterMetadata(directory, rank, scaling, nbytes, keys)


def load_peft_adapter(
    name: str,
    path: str | Path,
    arch: ArchConfig,
    max_lora_rank: int,
    allowed_roots: list[Path] | None = None,
) -> LoRAAdapter:
    """Check and read a PEFT LoRA adapter; raises LoRAAdapterError naming the file and problem
    (the files may have changed since the engine inspected them)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = inspect_peft_adapter(path, arch, max_lora_rank, allowed_roots)
    weights_path = meta.path / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"{weights_path}: unreadable: {exc}") from None
    if set(tensors) != set(meta.keys):
        raise LoRAAdapterError(f"{weights_path}: changed while it was being read")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, (layer, module, half) in meta.keys.items():
        halves.setdefault((layer, module), {})[half] = tensors[key].to(torch.float32)
    weights = {
        (layer, module): LoRAWeights(pair["A"].contiguous(), pair["B"].contiguous())
        for (layer, module), pair in sorted(halves.items())
    }
    return LoRAAdapter(name, meta.path, meta.rank, meta.scaling, _split_fused(weights, arch))


def _split_fused(
    weights: dict[tuple[int, str], LoRAWeights], arch: ArchConfig
) -> dict[tuple[int, str], LoRAWeights]:
    """The adapter as the model's parts: a fused projection's pair as one pair per part (the
    shared A, that part's rows of B), and where the model stores its q and k heads reordered
    (partial rotary, rankcast/model/rotary.py) the q and k rows of B in the same order, so each
    delta lands on the values it was made for."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    sizes |= {"gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size}
    order = (
        partial_rotary_order(arch.head_dim, arch.rotary_dim)
        if arch.rotary_dim < arch.head_dim
        else None
    )
    out: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), pair in weights.items():
        if module in FUSED:
            offset = 0
            for part in FUSED[module]:
                rows = pair.b.narrow(0, offset, sizes[part]).contiguous()
                out[(layer, part)] = LoRAWeights(pair.a, rows)
                offset += sizes[part]
        else:
            out[(layer, module)] = pair
    if order is not None:
        d = arch.head_dim
        for (layer, module), pair in list(out.items()):
            if module in ("q_proj", "k_proj"):
                b = pair.b.reshape(-1, d, pair.b.shape[1])[:, order].reshape(pair.b.shape)
                out[(layer, module)] = LoRAWeights(pair.a, b.contiguous())
    return out
