"""A rank's weights as loading leaves them (its shard, in the engine's dtype, the linears packed
for the CPU's kernels), saved once and mapped on every later start.

Loading a checkpoint reads every tensor, converts it to the engine's dtype, cuts this rank's
shard out of it and packs each linear for the kernels: ~0.45 s of SmolLM2-135M's warm start on a
2-core Zen 3, the same work on every start, writing the whole model into fresh pages. The result
depends only on the checkpoint's files, the dtype, the rank's place in the layout and the build of
the kernels that packed it, so it is saved once per such combination (safetensors, in the cache
directory) and a later start maps the file instead: copy-on-write pages of the page cache, ~0.03 s
for the same model, and engines on one machine that load the same shard share its memory.

The snapshot is written on a thread after the model is up (the write releases the GIL), so the
start that makes it is not delayed; a process that ends meanwhile waits for it at exit (the
thread is not a daemon). Written under a temporary name and renamed, a snapshot is whole or
absent. One that cannot be read or does not fit the model is removed and the checkpoint loaded
as before. Writing one also prunes the snapshots whose checkpoint or kernel build is gone or
changed, and staging files of processes that died while writing, then keeps the cache to its
budget (RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB, 20 GiB unless told): the least recently used
snapshots (a start that maps one marks it used) go first. One is never written where it would
leave the file system less than `MIN_FREE_BYTES` free: a cache must not fill the disk that the
KV cache's swap, logs or the next build need.

Engines use them unless `RANKCAST_WEIGHT_SNAPSHOTS=0` (`ModelConfig.weight_snapshots`);
`load_model` alone does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rankcast import envs, kernels
from rankcast.distributed import PipelineStage, TensorParallelGroup
from rankcast.model import ops
from rankcast.model.layers import PackedLinearMixin, layer_quantization, packed_linears
from rankcast.model.safetensors_file import open_safetensors
from rankcast.process import abandoned_staging, staging_name

logger = logging.getLogger(__name__)

# Bump when what a snapshot holds, or how it is named, changes.
# 3: a 4-bit model's LM head is q8_0 (was int8); 4: q8_0 keeps Q5_0 grids; 5: an LM head may be
# a GGUF's own Q6_K blocks (rankcast/model_files/stored_head.py).
SNAPSHOT_FORMAT = 5
_PACKED = "packed:"
_SCALES = "scales:"  # int8 weights' per-channel scales
_PARAM = "param:"
_WRITER = "weight-snapshot"  # the name of the thread that writes one
MIN_FREE_BYTES = 2 * 2**30  # what writing a snapshot leaves free on its file system, at least
# What quantized weights are packed as (csrc/gemm.cpp's int8, csrc/gemm_w8a8.cpp's offset bytes).
_PACKED_DTYPES = {
    "int8": torch.int8,
    "w8a8": torch.uint8,
    "q4_0": torch.uint8,
    "q4_1": torch.uint8,
    "q8_0": torch.int8,
    "q6_k": torch.uint8,
}
_SCALED = ("int8", "w8a8")  # schemes whose scales are a tensor of their own (groups': inside)


def snapshot_dir() -> Path:
    return envs.cache_dir() / "snapshots"


def writes_in_progress() -> list[Path]:
    """Snapshots some live process (this one or another) is still writing into this cache."""
    directory = snapshot_dir()
    if not directory.is_dir():
        return []
    return [path for path in directory.iterdir() if abandoned_staging(path.name) is False]


def wait_for_writes(timeout_s: float = 600.0) -> None:
    """Return once no snapshot is being written, this process's or a server's: a start that
    packed its weights writes them out in the background while it already serves (hundreds of
    MB, seconds of disk and memory traffic), and a benchmark must time the model, not that."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name == _WRITER:
            thread.join(max(0.0, deadline - time.monotonic()))
    while writes_in_progress():
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight snapshots still being written: {writes_in_progress()}")
        time.sleep(0.1)


def checkpoint_identity(model_dir: Path) -> str:
    """The checkpoint's files as the file system knows them (name, size, modification time,
    inode): a rewritten or replaced file changes it, so its old snapshot is not used."""
    parts = []
    for path in sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"]):
        stat = path.stat()
        parts.append([path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino])
    return json.dumps([str(model_dir.resolve()), parts])


@dataclass(frozen=True)
class WeightSnapshot:
    """Where one rank's snapshot lives, and what it was made from."""

    path: Path
    source: Path  # the checkpoint directory
    identity: str  # checkpoint_identity(source) when it was made
    kernels_library: Path  # the kernel build that packed it
    quantization: str = "none"  # one of quantization.SCHEMES: the linears are quantized
    # The bytes all snapshots in the cache may take together (RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB).
    cache_budget: int = int(envs.WEIGHT_SNAPSHOT_CACHE_GIB * 2**30)

    @classmethod
    def for_rank(
        cls,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup | None,
        pp: PipelineStage | None,
        linear_kernel: str,
        quantization: str = "none",
        expert_parallel: bool = False,
        cache_gib: float = envs.WEIGHT_SNAPSHOT_CACHE_GIB,
        stored_head: bool = False,
    ) -> WeightSnapshot | None:
        """This rank's snapshot location, or None where snapshots do not apply: the model's
        linears do not take rankcast's packed kernel (`linear_kernel`, the path chosen for
        them), whose layout is what a snapshot holds. So a start maps a snapshot only where it
        would have packed the same layout itself: what the cache holds never picks the path."""
        if linear_kernel != "rankcast" or not kernels.available(
            torch.empty(0, dtype=dtype, device=device)
        ):
            return None
        if not any(model_dir.glob("*.safetensors")):
            return None  # the loader reports the missing weights
        tp = tp or TensorParallelGroup()
        pp = pp or PipelineStage()
        library = kernels.library_path()
        identity = checkpoint_identity(model_dir)
        layout = [str(dtype), quantization, tp.rank, tp.size, pp.rank, pp.size, str(library)]
        if expert_parallel:  # whole experts per rank: another shard of the same checkpoint
            layout.append("expert-parallel")
        if stored_head:  # the LM head packed from the file's Q6_K blocks (loader.py)
            layout.append("q6_k-head")
        key = json.dumps([SNAPSHOT_FORMAT, identity, layout])
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        path = snapshot_dir() / f"{model_dir.name}-{digest}.safetensors"
        budget = int(cache_gib * 2**30)
        return cls(path, model_dir.resolve(), identity, library, quantization, budget)

    def restore(self, model: nn.Module) -> bool:
        """Give `model` (built, not loaded) the snapshot's weights; False, with the model
        untouched, where there is no usable snapshot."""
        if not self.path.is_file():
            return False
        try:
            handle = open_safetensors(self.path)
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except Exception as exc:
            return self._discard(f"cannot be read ({exc})")
        linears, params = _contents(model)
        schemes = {
            name: layer_quantization(module, self.quantization) for name, module, _ in linears
        }
        expected = {_PACKED + name for name, _, _ in linears} | {_PARAM + n for n in params}
        expected |= {_SCALES + name for name, scheme in schemes.items() if scheme in _SCALED}
        if set(tensors) != expected:
            return self._discard("holds other tensors than this model's")
        for name, param in params.items():
            saved = tensors[_PARAM + name]
            if saved.shape != param.shape or saved.dtype != param.dtype:
                return self._discard(f"{name} is {tuple(saved.shape)} {saved.dtype}")
        for name, module, _ in linears:
            packed_dtype = _PACKED_DTYPES.get(schemes[name], module.weight.dtype)
            if tensors[_PACKED + name].dtype != packed_dtype:
                return self._discard(f"{name} is packed in {tensors[_PACKED + name].dtype}")
        for name, param in params.items():
            param.data = tensors[_PARAM + name]
        for name, module, own in linears:
            out_features = module.weight.shape[0]
            scales = tensors.get(_SCALES + name)
            packed = ops.PackedWeight(
                tensors[_PACKED + name], "rankcast", out_features, scales, schemes[name]
            )
            module.adopt_packed(packed, release_plain=own)
        with contextlib.suppress(OSError):  # used now: the last the cache's budget removes
            os.utime(self.path)
        return True

    def _discard(self, why: str) -> bool:
        logger.warning("weight snapshot %s %s: removed, loading the checkpoint", self.path, why)
        with contextlib.suppress(OSError):
            self.path.unlink()
        return False

    def save_in_background(self, model: nn.Module) -> threading.Thread | None:
        """Start writing `model`'s weights (loaded and packed) as this snapshot; None where
        the model is not one a snapshot can hold (a linear left unpacked or packed by oneDNN,
        whose layout is its own, or a plain weight that packing did not release)."""
        linears, params = _contents(model)
        tensors: dict[str, torch.Tensor] = {}
        for name, module, own in linears:
            packed = module.packed_weight
            if packed is None or packed.backend != "rankcast":
                return None
            if own and module.weight.untyped_storage().nbytes() > module.weight.element_size():
                return None  # the plain weight was kept (tests that compare shards)
            if packed.quantization != layer_quantization(module, self.quantization):
                return None
            tensors[_PACKED + name] = packed.tensor
            if packed.scales is not None:
                tensors[_SCALES + name] = packed.scales
        tensors.update({_PARAM + name: param.detach() for name, param in params.items()})
        thread = threading.Thread(target=self._write, args=(tensors,), name=_WRITER, daemon=False)
        thread.start()
        return thread

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        directory = self.path.parent
        staging = directory / staging_name(self.path.name)
        size = sum(tensor.nbytes for tensor in tensors.values())
        try:
            directory.mkdir(parents=True, exist_ok=True)
            prune_stale_snapshots(directory)
            if size > self.cache_budget:
                logger.info(
                    "weight snapshot not saved: %.2f GiB is more than the cache's budget of "
                    "%.2f GiB (RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB)",
                    size / 2**30,
                    self.cache_budget / 2**30,
                )
                return
            evict_least_recently_used(directory, self.cache_budget - size)
            free = shutil.disk_usage(directory).free
            if free - size < MIN_FREE_BYTES:
                logger.warning(
                    "weight snapshot not saved: %s would be left with %.1f GiB free",
                    directory,
                    (free - size) / 2**30,
                )
                return
            metadata = {
                "format": "pt",
                "rankcast_snapshot": str(SNAPSHOT_FORMAT),
                "source": str(self.source),
                "identity": self.identity,
                "kernels": str(self.kernels_library),
            }
            save_file(tensors, str(staging), metadata=metadata)
            os.replace(staging, self.path)
            logger.info("saved the packed weights to %s for later starts", self.path)
        except Exception as exc:  # a cache: failing to write one costs the next start, no more
            logger.warning("could not save a weight snapshot to %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                staging.unlink()


def _contents(
    model: nn.Module,
) -> tuple[list[tuple[str, PackedLinearMixin, bool]], dict[str, nn.Parameter]]:
    """What a snapshot of `model` holds: each linear's packed weight (`packed_linears`) and
    every parameter but the plain weights packing releases (those a linear alone reads)."""
    linears = packed_linears(model)
    released = {id(module.weight) for _, module, own in linears if own}
    params = {n: p for n, p in model.named_parameters() if id(p) not in released}
    return linears, params


def prune_stale_snapshots(directory: Path) -> list[Path]:
    """Remove the snapshots no start can use any more (their checkpoint is gone or changed,
    or the kernel build that packed them is gone) and staging files of dead writers; return
    what was removed."""
    removed = []
    for path in directory.glob("*.safetensors"):
        abandoned = abandoned_staging(path.name)
        if abandoned if abandoned is not None else _is_stale(path):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def evict_least_recently_used(directory: Path, keep_bytes: int) -> list[Path]:
    """Remove the snapshots used longest ago (by modification time: written or last mapped)
    until those left take at most `keep_bytes`; return what was removed. A process mapping a
    removed one keeps its pages (the file goes when its last mapping does); its next start
    loads the checkpoint and writes the snapshot again."""
    snapshots = []
    for path in directory.glob("*.safetensors"):
        if abandoned_staging(path.name) is None:
            with contextlib.suppress(OSError):
                stat = path.stat()
                snapshots.append((stat.st_mtime_ns, stat.st_size, path))
    snapshots.sort()
    total = sum(size for _, size, _ in snapshots)
    removed = []
    for _, size, path in snapshots:
        if total <= keep_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
        total -= size
    return removed


def _is_stale(path: Path) -> bool:
    try:
        metadata = open_safetensors(path).metadata() or {}
        source = Path(metadata["source"])
        if metadata.get("rankcast_snapshot") != str(SNAPSHOT_FORMAT):
            return True
        if not Path(metadata["kernels"]).is_file():
            return True
        return checkpoint_identity(source) != metadata["identity"]
    except Exception:  # unreadable, without our metadata, or its checkpoint is gone
        return True
