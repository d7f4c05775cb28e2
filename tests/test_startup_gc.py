"""The garbage collector around start-up (rankcast/startup_gc.py): paused while an engine is
built, the result frozen, the collector back on in every case, and nothing kept after shutdown.

The ranks' side is in tests/engine/test_notification_gather.py (it needs their TP=2 engine)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankcast import LLM, SamplingParams
from rankcast.errors import ModelFormatError
from rankcast.startup_gc import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    """Each test starts with the collector enabled and nothing frozen, and leaves it so."""
    gc.enable()
    gc.unfreeze()
    yield
    gc.enable()
    gc.unfreeze()


@pytest.mark.usefixtures("collector_on")
def test_pause_restores_the_collector_even_when_the_block_raises() -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("start-up failed")
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_on")
def test_nested_pause_leaves_the_outer_one_in_charge_and_a_disabled_collector_disabled() -> None:
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.usefixtures("collector_on")
def test_offline_engine_freezes_its_start_up_and_keeps_nothing_after_shutdown(
    tiny_llama_dir: Path,
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space_gib=0.05)
    try:
        assert gc.isenabled()
        assert gc.get_freeze_count() > 10_000
        param = next(llm.engine.client.core.executor.worker.runner.model.parameters())
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
    kept = weakref.ref(param)
    del llm, param
    gc.collect()
    # The engine's objects form cycles: frozen, the model's weights would outlive it.
    assert kept() is None


@pytest.mark.usefixtures("collector_on")
def test_a_failed_start_leaves_the_collector_on_and_nothing_frozen(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # raised inside the pause, by the engine
    with pytest.raises(ModelFormatError, match=r"no \*\.safetensors"):
        LLM(str(tmp_path), dtype="float32")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
