"""The quantized formats on the Llama family's other members (Qwen3, SmolLM3, Phi-3, Gemma 3)
against transformers: each checkpoint's decoder projections are first made what a file of that
format holds (int8 per output channel, Q8_0's or Q4_1's 32-value groups, dequantized), so
transformers and rankcast multiply the very same weights, and rankcast then serves them packed
in that format (`--quantization`). What is left between the two is the quantized kernels' own
arithmetic, which must stay within 1 % of the logits' spread, prefill and decode, and pick
transformers' token wherever transformers' top two are not within that error of each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankcast.model import quantization as quantized
from rankcast.model.layers import PackedLinearMixin
from rankcast.model.loader import load_model
from rankcast.model_files.arch import ArchConfig
from rankcast.protocol import ScheduledSequence, SchedulerOutput
from rankcast.worker.model_runner import ModelRunner
from tests.model.family_models import PROMPTS, write_checkpoint

CPU = torch.device("cpu")
ARCHITECTURES = {
    "qwen3": {"num_hidden_layers": 2, "head_dim": 32},
    "smollm3": {"num_hidden_layers": 4},
    "phi3": {"num_hidden_layers": 2, "partial_rotary_factor": 0.75},
    "gemma3": {
        "num_hidden_layers": 3,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 20,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
}


def _as_the_file_holds_them(model_dir: Path, scheme: str) -> None:
    """Rewrite the decoder layers' projections (Phi-3's fused ones included) as a `scheme` file
    holds them: quantized, then dequantized to float32."""
    from safetensors.torch import load_file, save_file

    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, weight in tensors.items():
            if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
                continue
            out, width = weight.shape
            if scheme == "int8":
                values, scales = quantized.quantize_int8_weight(weight)
                rebuilt = values.float() * scales.float()[:, None]
            elif scheme == "q8_0":
                q8_values, d = quantized.quantize_q8_0_weight(weight)
                rebuilt = (q8_values.view(out, -1, 32).float() * d.float()[..., None]).view(out, -1)
            else:
                q4_values, d, m = quantized.quantize_q4_1_weight(weight)
                groups = q4_values.view(out, -1, 32).float() * d.float()[..., None]
                rebuilt = (groups + m.float()[..., None]).view(out, -1)
            tensors[name] = rebuilt[:, :width].contiguous().to(weight.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_a_quantized_model_answers_as_transformers_does_on_the_same_weights(
    tmp_path: Path, tokenizer_source: Path, model_type: str, scheme: str
) -> None:
    import transformers

    model_dir = write_checkpoint(
        tmp_path / "m", model_type, tokenizer_source, seed=11, **ARCHITECTURES[model_type]
    )
    _as_the_file_holds_them(model_dir, scheme)
    arch = ArchConfig.from_model_dir(model_dir)
    model = load_model(model_dir, arch, torch.float32, CPU, quantization=scheme)
    linears = [m for m in model.modules() if isinstance(m, PackedLinearMixin)]
    assert any(
        m.packed_weight is not None and m.packed_weight.quantization == scheme for m in linears
    )
    runner = ModelRunner(model, arch, 8, CPU, torch.float32)
    runner.initialize_cache(64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    tokens, table = list(PROMPTS[0]), [9, 2, 30, 4, 17, 50, 1, 3]
    step = ScheduledSequence("r", tokens, 0, table)
    for _ in range(6):
        ours = runner.compute_logits(SchedulerOutput([step]))[0]
        with torch.no_grad():
            theirs = reference(torch.tensor([tokens])).logits[0, -1]
        error = float((ours - theirs).abs().max())
        spread = float(theirs.max() - theirs.min())
        assert error < 0.01 * spread, (error, spread)
        top2 = theirs.topk(2).values
        if float(top2[0] - top2[1]) > 2 * error:
            assert int(ours.argmax()) == int(theirs.argmax())
        tokens.append(int(theirs.argmax()))
        step = ScheduledSequence("r", tokens[-1:], len(tokens) - 1, table)
