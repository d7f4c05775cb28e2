"""LoRA off the busy loop: an adapter a request needs is read on each rank's own thread, and the
requests already running keep decoding meanwhile; the request is admitted once every rank has
reported the adapter read."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import rankcast.worker.lora_manager as lora_manager
from rankcast import SamplingParams
from rankcast.channel.events import LoRAAdapterLoaded, NotificationsDropped
from rankcast.protocol import AddLoRA
from tests.lora.conftest import lora_llm

LONG = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_running_requests_decode_while_an_adapter_is_read_from_disk(
    tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    # One host slot: adding "b" pushes "a" back to disk, so a request on "a" needs a read. The
    # rank runs in its own process (mp), so the injected slow disk stays there.
    with lora_llm(
        tiny_llama_dir,
        max_loras=1,
        max_cpu_loras=1,
        distributed_executor_backend="mp",
        worker_extension_cls="tests.lora.slow_reads:SlowReads",
    ) as llm:
        engine = llm.engine
        engine.call(AddLoRA("a", str(mixed_adapters[0])))
        engine.call(AddLoRA("b", str(mixed_adapters[1])))
        assert {a.name: a.tiers for a in llm.list_loras()}["a"] == []
        llm.take_notifications()
        llm.collective_rpc("slow_down_reads", [1.0])

        base = engine.add_request([5, 17, 300, 42, 9], LONG)
        on_a = engine.add_request([7, 8, 9], SHORT, lora_name="a")
        base_tokens = 0
        base_tokens_before_a = None
        finished: set[str] = set()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == base:
                    base_tokens = len(output.outputs[0].token_ids)
                elif output.request_id == on_a and base_tokens_before_a is None:
                    base_tokens_before_a = base_tokens
                if output.finished:
                    finished.add(output.request_id)
        assert finished == {base, on_a}
        # A second of reading is many decode steps of the tiny model: the base request kept
        # going instead of the whole engine waiting for the disk.
        assert base_tokens_before_a is not None and base_tokens_before_a >= 20, (
            f"the base request made {base_tokens_before_a} tokens while 'a' was read"
        )
        loads = [
            n
            for n in llm.take_notifications()
            if isinstance(n, LoRAAdapterLoaded) and n.adapter_name == "a" and n.tier == "cpu"
        ]
        assert len(loads) == 1 and loads[0].seconds >= 1.0
        assert {a.name: a.tiers for a in llm.list_loras()}["a"] == ["device", "cpu"]


def test_an_adapter_is_ready_when_read_even_if_the_event_saying_so_is_dropped(
    tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    """Readiness comes from the rank's step reply (typed reads), never from the events: with a
    one-event buffer that loses the read's event, the request on the adapter still runs."""
    with lora_llm(
        tiny_llama_dir,
        max_loras=1,
        max_cpu_loras=1,
        worker_notification_buffer_size=1,
        worker_extension_cls="tests.lora.slow_reads:DroppedReadEvents",
    ) as llm:
        engine = llm.engine
        engine.call(AddLoRA("a", str(mixed_adapters[0])))
        engine.call(AddLoRA("b", str(mixed_adapters[1])))  # pushes "a" back to disk
        llm.take_notifications()
        llm.collective_rpc("drop_read_events")

        on_a = engine.add_request([7, 8, 9], SHORT, lora_name="a")
        deadline = time.monotonic() + 60
        finished = False
        while not finished:
            assert time.monotonic() < deadline, "the request on 'a' never ran: read lost"
            finished = any(o.request_id == on_a and o.finished for o in engine.step())
        events = llm.take_notifications()
        # The event that said so was lost, and the loss was reported as such.
        assert not [n for n in events if isinstance(n, LoRAAdapterLoaded) and n.adapter_name == "a"]
        assert any(isinstance(n, NotificationsDropped) for n in events)
        assert "cpu" in {a.name: a.tiers for a in llm.list_loras()}["a"]


def test_stopping_the_engine_waits_for_an_adapter_read_in_flight(
    tiny_llama_dir: Path, mixed_adapters: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine stopped while a rank reads an adapter in the background waits for the read: a
    read's thread left running as the interpreter exits is killed inside torch, which aborts
    the process (the KV cache's commit did exactly that, tests/entrypoints/test_llm_exit.py)."""
    read = lora_manager.load_peft_adapter

    def slow(*args: Any, **kwargs: Any) -> Any:  # a cold disk: the read is still going on
        time.sleep(0.5)
        return read(*args, **kwargs)

    monkeypatch.setattr(lora_manager, "load_peft_adapter", slow)
    llm = lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    try:
        engine = llm.engine
        engine.call(AddLoRA("a", str(mixed_adapters[0])))
        engine.call(AddLoRA("b", str(mixed_adapters[1])))  # "a" back to disk
        engine.add_request([7, 8, 9], SHORT, lora_name="a")
        deadline = time.monotonic() + 30
        while not _reading() and time.monotonic() < deadline:
            engine.step()
        assert _reading(), "no background read of 'a' started"
    finally:
        llm.shutdown()
    assert not _reading()


def _reading() -> bool:
    return any(t.name.startswith("lora-read-") and t.is_alive() for t in threading.enumerate())
