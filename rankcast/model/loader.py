"""Build a model for one rank and fill it from safetensors files, with progress and clear errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from rankcast import envs
from rankcast.distributed import PipelineStage, TensorParallelGroup
from rankcast.errors import ModelFormatError
from rankcast.model import ops
from rankcast.model.layers import prepack_linears
from rankcast.model.linear_kernels import choose_linear_path
from rankcast.model.llama import LlamaForCausalLM
from rankcast.model.quantization import FOUR_BIT
from rankcast.model.safetensors_file import open_safetensors
from rankcast.model.weight_snapshot import WeightSnapshot
from rankcast.model_files.arch import ArchConfig
from rankcast.model_files.stored_head import STORED_HEAD_FILE, has_stored_head, stored_head_rows

logger = logging.getLogger(__name__)


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of every *.safetensors file, memory-mapped, in file order."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir}: no *.safetensors weights found")
    for file in files:
        try:
            handle = open_safetensors(file)
            names = list(handle.keys())
        except Exception as exc:
            raise ModelFormatError(f"{file}: cannot be read as safetensors ({exc})") from None
        for name in tqdm(
            names, desc=f"Loading {file.name}", unit="tensor", disable=envs.disable_progress()
        ):
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:
                raise ModelFormatError(f"{file}: tensor {name} is unreadable ({exc})") from None
            yield name, tensor


def load_model(
    model_dir: Path,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    pp: PipelineStage | None = None,
    keep_plain_weights: bool = False,
    weight_snapshots: bool = False,
    snapshot_cache_gib: float = envs.WEIGHT_SNAPSHOT_CACHE_GIB,
    linear_kernel: str = "auto",
    quantization: str = "none",
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """Construct this rank's slice of the model and load its shard of the weights.

    The linears' weights end up packed for the CPU's kernels, their plain copies released
    (`prepack_linears`) unless `keep_plain_weights` (tests that compare loaded shards). With
    `weight_snapshots` (the engine's setting), a snapshot of this rank's weights
    (rankcast/model/weight_snapshot.py) is mapped instead of loading where there is one, and
    written in the background after loading where there is none, in a cache kept to
    `snapshot_cache_gib` (RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB). `linear_kernel` is the
    engine's RANKCAST_LINEAR_KERNEL: every linear takes the path `choose_linear_path` makes of
    it, whatever a snapshot holds (one of another path is not used). `quantization` (a
    scheme of rankcast/model/quantization.py, or "none") quantizes the linears' weights.
    `expert_parallel`: each tensor-parallel rank holds whole experts (rankcast/model/moe.py)."""
    path = choose_linear_path(dtype, device, linear_kernel, quantization=quantization)
    weights = f"{dtype}" if quantization == "none" else f"{dtype}, {quantization} weights"
    logger.info("%s linears run %s", weights, path.describe())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(arch, tp, pp, expert_parallel)
    finally:
        torch.set_default_dtype(previous)
    stored_head = _serves_stored_head(model, model_dir, path.kernel, quantization)
    if stored_head:  # before a snapshot is looked for: the head's scheme is part of one
        assert model.lm_head is not None
        model.lm_head.serves_stored_q6_k = True
        logger.info(
            "the LM head multiplies the file's Q6_K blocks as stored (%s)", STORED_HEAD_FILE
        )
    snapshot = None
    if weight_snapshots and not keep_plain_weights:
        snapshot = WeightSnapshot.for_rank(
            model_dir,
            dtype,
            device,
            tp,
            pp,
            path.kernel,
            quantization,
            expert_parallel,
            cache_gib=snapshot_cache_gib,
            stored_head=stored_head,
        )
    if snapshot is not None and snapshot.restore(model):
        logger.info("weights mapped from %s", snapshot.path)
        return model.eval()
    loaded = model.load_weights(iterate_safetensors(model_dir))
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFormatError(f"{model_dir}: checkpoint lacks {len(missing)} tensors: {shown}")
    if stored_head:
        head = model.lm_head
        assert head is not None
        head.q6_k_blocks = stored_head_rows(model_dir, head.vocab_start, head.rows_per_rank)
    prepack_linears(model, path.kernel, not keep_plain_weights, quantization)
    if snapshot is not None:
        snapshot.save_in_background(model)
    return model.eval()


def _serves_stored_head(
    model: LlamaForCausalLM, model_dir: Path, kernel: str, quantization: str
) -> bool:
    """Whether this rank's LM head multiplies the GGUF file's own Q6_K blocks
    (rankcast/model_files/stored_head.py): the conversion kept them, the head takes a group
    scheme (`layer_quantization`), and this build runs csrc/gemm_q6k.cpp."""
    if model.lm_head is None or quantization not in (*FOUR_BIT, "q8_0") or kernel != "rankcast":
        return False
    return has_stored_head(model_dir) and ops.q6_k_supported()
