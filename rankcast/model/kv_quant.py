"""The KV cache's element type (`--kv-cache-dtype`) and its 8-bit formats in plain torch.

A 16-bit cache holds keys and values in the activations' dtype. An 8-bit one (int8, fp8 e4m3 or
e5m2, vLLM's names) holds each token's key and value of each head as bytes with one float32 scale
apiece, amax / the format's largest value, set when the token is written: its bytes then depend
on its own values only, so a token reads the same whatever it was batched or chunked with, and a
prefix-cache hit reads what the first request wrote. Half the bytes a token reads from a bfloat16
cache, plus 8 bytes of scales per head (for SmolLM2's 64-wide heads: 0.56 of the bytes), and as
much more context in the same memory.

The CPU kernels (csrc/attention.cpp) write and read these formats themselves; what is here is the
torch path's (CUDA, or a CPU without the kernels), which stores the same bytes: the same amax,
the same division by multiplying with 1 / scale, rounding to nearest even.
"""

from __future__ import annotations

import torch

from rankcast.config import ConfigError

# The 8-bit names of --kv-cache-dtype (rankcast.config.KV_CACHE_DTYPES): "fp8" is e4m3, as vLLM
# reads it.
_EIGHT_BIT: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

# Each 8-bit format's largest finite value: where a head's largest magnitude is scaled to.
LARGEST: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def cache_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The torch dtype `--kv-cache-dtype name` stores with `activations` (the model's dtype).
    A 16-bit or 32-bit cache is the activations' own dtype: the attention kernels read the
    cache in the query's dtype, so another one is refused here, by name."""
    if name in _EIGHT_BIT:
        return _EIGHT_BIT[name]
    if name == "auto":
        return activations
    wanted = getattr(torch, name, None)
    if wanted != activations:
        raise ConfigError(
            f"--kv-cache-dtype {name} needs --dtype {name}: a 16- or 32-bit KV cache holds the "
            f"activations' dtype ({str(activations).removeprefix('torch.')}); the 8-bit ones "
            f"(int8, fp8, fp8_e4m3, fp8_e5m2) go with any"
        )
    return activations


def is_8bit(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds bytes with per-token scales."""
    return dtype in LARGEST


def dtype_name(dtype: torch.dtype) -> str:
    """The name /metrics and the start-up log give a cache dtype: vLLM's where it has one."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def quantize_heads(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes of `dtype`, float32 scales [...]) for heads x [..., D]: each head scaled so its
    largest magnitude is the format's largest value, rounded to nearest even (int8 and fp8 alike,
    as the kernels round), clamped there."""
    largest = LARGEST[dtype]
    values = x.float()
    scale = values.abs().amax(dim=-1) / largest
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = (values * inverse.unsqueeze(-1)).clamp(-largest, largest)
    if dtype == torch.int8:
        return scaled.round().to(torch.int8), scale
    return scaled.to(dtype), scale


def read_blocks(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    index: torch.Tensor,
    dtype: torch.dtype,
    keys: bool,
) -> torch.Tensor:
    """Blocks `index` of a key cache ([..., Hkv, D, bs]) or value cache ([..., Hkv, bs, D]) in
    `dtype`, an 8-bit one decoded with its per-token scales ([..., Hkv, bs])."""
    blocks = cache[index]
    if scale is None:
        return blocks
    per_token = scale[index].unsqueeze(-2 if keys else -1)
    return (blocks.float() * per_token).to(dtype)
