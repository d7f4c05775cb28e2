"""Shared fixtures: tiny random-weight checkpoints written in HF format, and the embedded model."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch

os.environ.setdefault("RANKCAST_DISABLE_PROGRESS", "1")
# The suite kills engine cores dozens of times: every launcher it starts restarts one after
# 0.1 s, then 0.2 s, instead of the default 1 s, then 2 s (the rule, three failures in five
# minutes and it gives up, is the same; tests/reliability/test_supervision.py holds the default).
os.environ.setdefault("RANKCAST_RESTART_BACKOFF_S", "0.1,0.2")
# Each kernel build, dtype, quantization and layout the suite starts the embedded model with
# leaves a snapshot of it in the user's cache (~50 of them, 3.3 GB, in one run): the suite keeps
# them to 4 GiB, least recently used out first, and so takes that budget through its paces.
os.environ.setdefault("RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB", "4")
torch.set_num_threads(2)


def _one_tls_context_for_every_http_client() -> None:
    """Every httpx client the tests make (and the openai and anthropic SDKs' clients) verifies
    with one TLS context made once, instead of building one per client.

    httpx makes a fresh context and loads the whole CA bundle into it for each client, ~27 ms
    of CPU, even for the plain-HTTP loopback URLs these tests use; the polling loops (waiting
    for health, for both servers to answer, for a restart) make hundreds of short-lived
    clients a file (735 in test_mixed_fleet.py), CPU taken from the engines they wait on.
    Only a client left at the default `verify=True` is changed; one given its own keeps it."""
    import ssl

    import httpx

    shared = ssl.create_default_context()
    for transport in (httpx.HTTPTransport, httpx.AsyncHTTPTransport):
        made = transport.__init__

        def init(self: object, *args: object, _made: object = made, **kwargs: object) -> None:
            if kwargs.get("verify", True) is True:
                kwargs["verify"] = shared
            _made(self, *args, **kwargs)  # type: ignore[operator]

        transport.__init__ = init  # type: ignore[method-assign]


_one_tls_context_for_every_http_client()

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 49152,
    tokenizer_from: Path | None = None,
    **overrides: object,
) -> Path:
    """Write a random-weight HF checkpoint; copy a tokenizer in so the engine can serve it."""
    import transformers

    torch.manual_seed(seed)
    settings = {**TINY_LLAMA, "vocab_size": vocab_size, **overrides}
    if arch == "qwen2":
        config = transformers.Qwen2Config(**settings)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**settings)
        model = transformers.LlamaForCausalLM(config)
    # Random init gives near-uniform logits; a wider spread makes greedy choices well separated.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, path / name)
    return path


def reference_greedy(
    model_dir: Path, prompt: list[int], count: int, adapter: Path | None = None
) -> list[int]:
    """The `count` tokens transformers (with `adapter` through peft, if given) picks greedily
    after `prompt`, in float32 on the CPU: the reference generated text is held to."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter))
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the other CPU families' kernel builds in the background (at idle priority) when
    their tests were collected: they compile while the rest of the suite runs
    (tests/kernel_family_builds.py)."""
    from tests import kernel_family_builds

    if any("test_cpu_families.py" in item.nodeid for item in session.items):
        kernel_family_builds.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import kernel_family_builds

    kernel_family_builds.stop()


_FAMILY_TESTS = "tests/model/test_cpu_families.py"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite runs in random order (pytest-randomly, seed printed at the top); a module
    marked `scenario` is one session told in steps, so its tests keep their file order (the
    module itself still lands anywhere in the run). The other CPU families' kernel tests run
    last: their builds compile on the CPU the rest of the suite leaves idle, and are done by
    then (tests/kernel_family_builds.py)."""
    families = [item for item in items if item.nodeid.startswith(_FAMILY_TESTS)]
    items[:] = [item for item in items if not item.nodeid.startswith(_FAMILY_TESTS)] + families
    start = 0
    while start < len(items):
        end = start
        module = items[start].nodeid.split("::")[0]
        while end < len(items) and items[end].nodeid.split("::")[0] == module:
            end += 1
        if items[start].get_closest_marker("scenario") is not None:
            items[start:end] = sorted(items[start:end], key=lambda item: item.reportinfo()[1] or 0)
        start = end


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fail the run if any test left a child process (engine core, rank, API server) alive."""
    yield
    from tests.entrypoints.server_process import descendants, process_title

    def ours() -> list[str]:
        # multiprocessing's resource tracker lives as long as this process, by design.
        titles = [process_title(pid) for pid in descendants(os.getpid())]
        return [t for t in titles if "resource_tracker" not in t]

    deadline = time.monotonic() + 15
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ours(), f"processes left behind by the tests: {ours()}"


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded SmolLM2 GGUF, converted once (cached across sessions)."""
    from rankcast.model_files.source import resolve_model

    return resolve_model(None).model_dir


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    from rankcast.model_files.source import embedded_gguf_path

    return embedded_gguf_path()


@pytest.fixture(scope="session")
def tokenizer_source(request: pytest.FixtureRequest) -> Path:
    """Where the tiny models' tokenizer comes from: the embedded model's, or the directory
    RANKCAST_TEST_TOKENIZER_DIR names (a machine without the embedded model, such as the GPU
    machine the CUDA tests run on, which cannot take its 98 MB file along)."""
    given = os.environ.get("RANKCAST_TEST_TOKENIZER_DIR")
    if given:
        return Path(given)
    return cast(Path, request.getfixturevalue("embedded_model_dir"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=tokenizer_source)


@pytest.fixture(scope="session")
def smollm_fp32():
    """One float32 engine over the embedded model, shared by tests that only read from it."""
    from rankcast import LLM

    llm = LLM(dtype="float32", kv_cache_space_gib=0.5, max_num_seqs=32)
    yield llm
    llm.shutdown()
