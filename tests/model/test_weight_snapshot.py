"""Weight snapshots: a rank's loaded, packed weights saved once and mapped on later starts,
never used for a checkpoint or kernel build they were not made from."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rankcast.config import ConfigError, ModelConfig
from rankcast.distributed import TensorParallelGroup
from rankcast.model.layers import PackedLinearMixin
from rankcast.model.linear_kernels import CpuFacts, choose_linear_path
from rankcast.model.llama import LlamaForCausalLM
from rankcast.model.loader import load_model
from rankcast.model.weight_snapshot import (
    WeightSnapshot,
    prune_stale_snapshots,
    wait_for_writes,
    writes_in_progress,
)
from rankcast.model_files.arch import ArchConfig
from tests.conftest import write_tiny_model

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    choose_linear_path(torch.float32, CPU).kernel != "rankcast",
    reason="snapshots hold the layout of rankcast's packed kernel, not built here",
)
MAPPED = "weights mapped from"


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage() + "\n"


@contextlib.contextmanager
def captured(name: str) -> Iterator[_Log]:
    """The named logger's messages, on a handler of its own: an engine started earlier in the
    session stops rankcast's loggers propagating to pytest's capture."""
    logger, handler = logging.getLogger(name), _Log()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RANKCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RANKCAST_WEIGHT_SNAPSHOTS", raising=False)
    monkeypatch.delenv("RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB", raising=False)
    return tmp_path / "cache" / "snapshots"


def _wait_for_snapshot(snapshot: WeightSnapshot, deadline_s: float = 30.0) -> None:
    """The snapshot is written on a thread and renamed into place whole: wait for the name."""
    deadline = time.monotonic() + deadline_s
    while not snapshot.path.is_file():
        assert time.monotonic() < deadline, f"no snapshot at {snapshot.path}"
        time.sleep(0.02)


def _load(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    keep_plain_weights: bool = False,
    weight_snapshots: bool = True,
    linear_kernel: str = "auto",
    cache_gib: float = 20.0,
) -> LlamaForCausalLM:
    """Load as an engine's rank does (snapshots on, unless told otherwise)."""
    if choose_linear_path(dtype, CPU).kernel != "rankcast":
        pytest.skip(f"{dtype} linears do not take rankcast's packed kernel here")
    arch = ArchConfig.from_model_dir(model_dir)
    return load_model(
        model_dir,
        arch,
        dtype,
        CPU,
        keep_plain_weights=keep_plain_weights,
        weight_snapshots=weight_snapshots,
        snapshot_cache_gib=cache_gib,
        linear_kernel=linear_kernel,
    )


def _computed(model: LlamaForCausalLM) -> torch.Tensor:
    """What the weights compute: every packed linear (the head too) and the embedding on fixed
    inputs, and the norms' weights."""
    gen = torch.Generator().manual_seed(0)
    outs = []
    for module in model.modules():
        if isinstance(module, PackedLinearMixin):
            x = torch.randn(3, module.weight.shape[1], generator=gen).to(module.weight.dtype)
            outs.append(module.matmul(x, module.weight, None).float().flatten())
    ids = torch.tensor([1, 2, 3])
    assert model.embed_tokens is not None
    outs.append(model.embed_tokens(ids).float().flatten())
    outs += [p.detach().float().flatten() for n, p in model.named_parameters() if "norm" in n]
    return torch.cat(outs)


def _snapshot_of(model_dir: Path, dtype: torch.dtype = torch.float32) -> WeightSnapshot:
    snapshot = WeightSnapshot.for_rank(model_dir, dtype, CPU, None, None, "rankcast")
    assert snapshot is not None
    return snapshot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_a_second_load_maps_the_snapshot_and_computes_the_same(
    tmp_path: Path, cache: Path, dtype: torch.dtype, tied: bool
) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250, tie_word_embeddings=tied)
    with captured("rankcast.model.loader") as log:
        first = _load(model_dir, dtype)
        assert MAPPED not in log.text
        snapshot = _snapshot_of(model_dir, dtype)
        _wait_for_snapshot(snapshot)
        second = _load(model_dir, dtype)
    assert f"{MAPPED} {snapshot.path}" in log.text
    assert torch.equal(_computed(first), _computed(second))
    # Plain weights stay released (one copy of each linear) except a head tied to the embedding.
    assert second.lm_head is not None and second.embed_tokens is not None
    assert (second.lm_head.weight is second.embed_tokens.weight) == tied
    for module in second.modules():
        if isinstance(module, PackedLinearMixin) and not (tied and module is second.lm_head):
            assert module.weight.untyped_storage().nbytes() == module.weight.element_size()
    plain = _load(model_dir, dtype, keep_plain_weights=True)
    assert plain.embed_tokens is not None
    assert torch.equal(plain.embed_tokens.weight, second.embed_tokens.weight)


def test_a_tensor_parallel_shard_has_a_snapshot_of_its_own(tmp_path: Path, cache: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250, tie_word_embeddings=False)
    arch = ArchConfig.from_model_dir(model_dir)
    ranks = [TensorParallelGroup(rank=r, size=2) for r in range(2)]
    paths = set()
    for tp in ranks:
        loaded = load_model(model_dir, arch, torch.float32, CPU, tp=tp, weight_snapshots=True)
        snapshot = WeightSnapshot.for_rank(model_dir, torch.float32, CPU, tp, None, "rankcast")
        assert snapshot is not None
        _wait_for_snapshot(snapshot)
        paths.add(snapshot.path)
        mapped = load_model(model_dir, arch, torch.float32, CPU, tp=tp, weight_snapshots=True)
        for (name, a), (_, b) in zip(loaded.named_modules(), mapped.named_modules(), strict=True):
            if isinstance(a, PackedLinearMixin):
                assert a.packed_weight is not None and b.packed_weight is not None
                assert torch.equal(a.packed_weight.tensor, b.packed_weight.tensor), name
    assert len(paths) == 2


def test_a_rewritten_checkpoint_is_loaded_not_its_old_snapshot(tmp_path: Path, cache: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250, seed=1)
    _load(model_dir)
    old = _snapshot_of(model_dir)
    _wait_for_snapshot(old)
    write_tiny_model(model_dir, vocab_size=250, seed=2)  # same shapes, other weights
    fresh = _snapshot_of(model_dir)
    assert fresh.path != old.path
    with captured("rankcast.model.loader") as log:
        reloaded = _load(model_dir)
    assert MAPPED not in log.text
    reference = _load(model_dir, keep_plain_weights=True)
    assert torch.equal(_computed(reloaded), _computed(reference))
    # Writing the new checkpoint's snapshot removed the old one, which nothing can use.
    _wait_for_snapshot(fresh)
    assert not old.path.exists()


def test_an_unreadable_snapshot_is_removed_and_the_checkpoint_loaded(
    tmp_path: Path, cache: Path
) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250)
    reference = _computed(_load(model_dir, keep_plain_weights=True))
    snapshot = _snapshot_of(model_dir)
    snapshot.path.parent.mkdir(parents=True)
    snapshot.path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with captured("rankcast.model.weight_snapshot") as log:
        model = _load(model_dir)
    assert "cannot be read" in log.text and str(snapshot.path) in log.text
    assert torch.equal(_computed(model), reference)
    _wait_for_snapshot(snapshot)  # rewritten whole from the checkpoint
    assert torch.equal(_computed(_load(model_dir)), reference)


def test_a_snapshot_of_another_model_is_refused_before_anything_is_touched(
    tmp_path: Path, cache: Path
) -> None:
    small = write_tiny_model(tmp_path / "small", vocab_size=250)
    big = write_tiny_model(tmp_path / "big", vocab_size=300)
    _load(small)
    _wait_for_snapshot(_snapshot_of(small))
    wrong = _snapshot_of(big)
    wrong.path.write_bytes(_snapshot_of(small).path.read_bytes())
    model = LlamaForCausalLM(ArchConfig.from_model_dir(big))
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with captured("rankcast.model.weight_snapshot") as log:
        assert not wrong.restore(model)
    assert "removed" in log.text and not wrong.path.exists()
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, PackedLinearMixin))


def test_no_snapshot_when_turned_off_or_when_plain_weights_are_kept(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250)
    _load(model_dir, keep_plain_weights=True)
    _load(model_dir, weight_snapshots=False)
    wait_for_writes(timeout_s=30)  # a snapshot's writer would have started by now
    assert not cache.exists() or not any(cache.iterdir())
    assert ModelConfig().weight_snapshots
    monkeypatch.setenv("RANKCAST_WEIGHT_SNAPSHOTS", "0")
    assert not ModelConfig().weight_snapshots
    monkeypatch.setenv("RANKCAST_WEIGHT_SNAPSHOTS", "maybe")
    with pytest.raises(ConfigError, match="RANKCAST_WEIGHT_SNAPSHOTS must be 0 or 1"):
        ModelConfig()


def test_an_engine_writes_its_snapshot_and_maps_it_on_the_next_start(
    tmp_path: Path, cache: Path, tiny_llama_dir: Path
) -> None:
    from rankcast import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts, logs = [], []
    for _ in range(2):
        with captured("rankcast.model.loader") as log:
            llm = LLM(str(tiny_llama_dir), kv_cache_space_gib=0.05)
        logs.append(log.text)
        try:
            worker = llm.engine.client.core.executor.worker  # in-process: one rank
            assert worker.runner is not None
            texts.append(llm.generate(["Hello there"], params)[0].outputs[0].token_ids)
            snapshot = _snapshot_of(tiny_llama_dir, worker.dtype)
            _wait_for_snapshot(snapshot)
        finally:
            llm.shutdown()
    assert texts[0] == texts[1]
    assert MAPPED not in logs[0] and f"{MAPPED} {snapshot.path}" in logs[1]
    assert [p.name for p in cache.iterdir()] == [snapshot.path.name]


def test_pruning_removes_what_no_start_can_use(tmp_path: Path, cache: Path) -> None:
    kept_dir = write_tiny_model(tmp_path / "kept", vocab_size=250)
    gone_dir = write_tiny_model(tmp_path / "gone", vocab_size=250)
    for model_dir in (kept_dir, gone_dir):
        _load(model_dir)
        _wait_for_snapshot(_snapshot_of(model_dir))
    kept, gone = _snapshot_of(kept_dir), _snapshot_of(gone_dir)
    for path in gone_dir.iterdir():
        path.unlink()
    gone_dir.rmdir()
    dead = cache / f".staging-{_dead_pid()}-x.safetensors"
    live = cache / f".staging-{os.getpid()}-y.safetensors"
    foreign = cache / "not-ours.safetensors"
    for path in (dead, live, foreign):
        path.write_bytes(b"partial")
    removed = set(prune_stale_snapshots(cache))
    assert removed == {gone.path, dead, foreign}
    assert kept.path.exists() and live.exists()


def test_the_cache_keeps_to_its_budget_dropping_the_least_recently_used(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for two snapshots of three models: writing the third removes the one used longest
    ago, and mapping a snapshot counts as a use (the first, mapped again, stays)."""
    first, second, third = (write_tiny_model(tmp_path / n, vocab_size=250) for n in "abc")
    _load(first)
    wait_for_writes()
    size = _snapshot_of(first).path.stat().st_size
    budget = 2.5 * size / 2**30
    _load(second, cache_gib=budget)
    wait_for_writes()
    # Uses set apart on the clock (file times can share a tick): first, then second.
    os.utime(_snapshot_of(first).path, (1_000_000, 1_000_000))
    os.utime(_snapshot_of(second).path, (2_000_000, 2_000_000))
    with captured("rankcast.model.loader") as log:
        _load(first, cache_gib=budget)  # mapped: now the most recently used
    assert f"{MAPPED} {_snapshot_of(first).path}" in log.text
    _load(third, cache_gib=budget)
    wait_for_writes()
    kept = {path.name for path in cache.iterdir()}
    assert kept == {_snapshot_of(first).path.name, _snapshot_of(third).path.name}
    os.utime(_snapshot_of(first).path, (3_000_000, 3_000_000))  # now first is the older
    os.utime(_snapshot_of(third).path, (4_000_000, 4_000_000))
    with captured("rankcast.model.loader") as log:
        _load(second, cache_gib=budget)  # loaded from its checkpoint, its snapshot written again
    assert MAPPED not in log.text
    wait_for_writes()
    assert _snapshot_of(second).path.is_file() and not _snapshot_of(first).path.exists()

    assert ModelConfig().weight_snapshot_cache_gib == 20.0
    monkeypatch.setenv("RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB", "0.5")
    assert ModelConfig().weight_snapshot_cache_gib == 0.5
    monkeypatch.setenv("RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB", "-1")
    with pytest.raises(ConfigError, match="RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB must be"):
        ModelConfig()


def test_no_snapshot_beyond_the_budget_or_onto_a_nearly_full_disk(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot larger than the whole budget, or one that would leave its file system with
    less than MIN_FREE_BYTES free (a nearly full disk, made here by asking for more free space
    than the disk has), is not written, and nothing already cached is removed for it; the model
    loads and computes as without snapshots."""
    import shutil

    from rankcast.model import weight_snapshot

    kept = write_tiny_model(tmp_path / "kept", vocab_size=250)
    _load(kept)
    wait_for_writes()
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250)
    reference = _computed(_load(model_dir, keep_plain_weights=True))
    with captured("rankcast.model.weight_snapshot") as log:
        torch.testing.assert_close(_computed(_load(model_dir, cache_gib=0)), reference)
        wait_for_writes()
    assert "more than the cache's budget" in log.text
    disk = shutil.disk_usage(cache).total
    monkeypatch.setattr(weight_snapshot, "MIN_FREE_BYTES", disk)
    with captured("rankcast.model.weight_snapshot") as log:
        torch.testing.assert_close(_computed(_load(model_dir)), reference)
        wait_for_writes()
    assert "would be left with" in log.text
    assert [path.name for path in cache.iterdir()] == [_snapshot_of(kept).path.name]


def test_a_benchmark_waits_for_snapshots_being_written(tmp_path: Path, cache: Path) -> None:
    """What benchmarks wait on before they time anything: this process's writer threads, and
    the staging files of live writers (a server's worker); a dead writer's file is no write."""
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250)
    _load(model_dir)
    wait_for_writes(timeout_s=60)  # this process's writer: joined, the snapshot in place
    assert _snapshot_of(model_dir).path.is_file() and writes_in_progress() == []
    dead = cache / f".staging-{_dead_pid()}-x.safetensors"
    live = cache / f".staging-{os.getpid()}-y.safetensors"
    for path in (dead, live):
        path.write_bytes(b"partial")
    assert writes_in_progress() == [live]
    with pytest.raises(TimeoutError, match="still being written"):
        wait_for_writes(timeout_s=0.3)
    live.unlink()
    wait_for_writes(timeout_s=5)


def _dead_pid() -> int:
    """A pid no process has: a child that has exited and been reaped."""
    import subprocess
    import sys

    code = "import os; print(os.getpid())"
    child = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(child.stdout)


def test_the_path_is_chosen_by_the_setting_never_by_what_the_cache_holds(
    tmp_path: Path, cache: Path
) -> None:
    """A start forced onto oneDNN (RANKCAST_LINEAR_KERNEL=onednn) neither maps the packed
    snapshot an earlier start left nor writes one: its linears run what was chosen."""
    if torch.float32 not in CpuFacts.of_this_machine().onednn:
        pytest.skip("oneDNN cannot pack float32 here")
    model_dir = write_tiny_model(tmp_path / "m", vocab_size=250)
    _load(model_dir)
    snapshot = _snapshot_of(model_dir)
    _wait_for_snapshot(snapshot)
    written = snapshot.path.stat().st_mtime_ns
    with captured("rankcast.model.loader") as log:
        forced = _load(model_dir, linear_kernel="onednn")
    assert MAPPED not in log.text
    backends = {m.packed_weight.backend for m in forced.modules() if _packed(m)}
    assert backends == {"onednn"}
    wait_for_writes()
    assert snapshot.path.stat().st_mtime_ns == written
    reference = _load(model_dir, keep_plain_weights=True)
    torch.testing.assert_close(_computed(forced), _computed(reference), atol=1e-4, rtol=1e-5)
    with captured("rankcast.model.loader") as log:
        _load(model_dir)  # back on auto: the snapshot is still there to map
    assert f"{MAPPED} {snapshot.path}" in log.text


def _packed(module: torch.nn.Module) -> bool:
    return isinstance(module, PackedLinearMixin) and module.packed_weight is not None
