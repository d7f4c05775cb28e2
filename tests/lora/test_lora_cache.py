"""The adapter cache, offline: device slots and the host tier, eviction (least recently used
from a slot, least asked for from the host tier) that spares running and pinned adapters, and
the scheduler deferring a request whose adapter has no slot yet.

Each check reads the lifecycle events the ranks published, so what is asserted is what an
operator would see, and the greedy outputs, which a slot overwritten under a running request
would corrupt.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rankcast import LLM, LoRARequest, SamplingParams
from rankcast.channel.events import LoRAAdapterEvicted
from rankcast.channel.lora_events import lora_event_name
from rankcast.lora.peft_adapter import load_peft_adapter
from rankcast.protocol import AddLoRA, RemoveLoRA
from tests.lora.conftest import lora_llm, make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 9]


def _lifecycle(llm: LLM) -> list[tuple[str, str, str]]:
    """(event, adapter, tier or reason) of the LoRA events since the last call."""
    out = []
    for n in llm.take_notifications():
        event = lora_event_name(n)
        if event is not None:
            detail = n.reason if isinstance(n, LoRAAdapterEvicted) else getattr(n, "tier", "")
            out.append((event, n.adapter_name, detail))  # type: ignore[attr-defined]
    return out


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def requests(mixed_adapters: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(name, str(path)) for name, path in zip("abc", mixed_adapters, strict=True)]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: Path, requests: list[LoRARequest]) -> dict[str, list[int]]:
    """Each adapter's greedy output with a slot of its own: the reference."""
    with lora_llm(tiny_llama_dir, max_loras=3) as llm:
        return {
            r.name: _tokens(llm.generate([PROMPT], GREEDY, lora_request=r))[0] for r in requests
        }


def test_one_slot_two_adapters_defers_rather_than_evicting_a_running_adapter(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]]
) -> None:
    a, b = requests[:2]
    # Turns off: with them, b's first token would end a's turn after a step and park it.
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_turn_steps=0) as llm:
        outputs = llm.generate([PROMPT] * 4, GREEDY, lora_request=[a, b, a, b])
        events = _lifecycle(llm)
    # Both a-requests ran together, then b took the slot: had b been let in (or a evicted)
    # while a ran, a's tokens would have come from b's weights.
    assert _tokens(outputs) == [alone["a"], alone["b"], alone["a"], alone["b"]]
    assert events == [
        ("loaded", "a", "cpu"),
        ("activated", "a", "device"),
        ("loaded", "b", "cpu"),  # no free slot: b waits in the host tier
        ("evicted", "a", "lru"),  # only once a's requests finished
        ("activated", "b", "device"),
    ]


def test_lru_eviction_skips_the_pinned_adapter_and_unpin_releases_it(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]]
) -> None:
    _, b, c = requests
    with lora_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=3) as llm:
        for r in requests:
            llm.generate([PROMPT], GREEDY, lora_request=r)
        _lifecycle(llm)
        # Device: b, c (a was evicted for c). Pin a: it comes back in place of b, the LRU one.
        assert llm.pin_lora("a").pinned is True
        assert _lifecycle(llm) == [
            ("evicted", "b", "lru"),
            ("activated", "a", "device"),
            ("pinned", "a", "device"),
        ]
        # Pinning used a just now; use c after it, so that a is certainly the least recently
        # used of the device pair: only the pin can explain b evicting c rather than a.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=c)) == [alone["c"]]
        assert _lifecycle(llm) == []
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=b)) == [alone["b"]]
        assert _lifecycle(llm) == [("evicted", "c", "lru"), ("activated", "b", "device")]
        llm.pin_lora("a", pinned=False)
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=c)) == [alone["c"]]
        assert _lifecycle(llm) == [
            ("unpinned", "a", "device"),
            ("evicted", "a", "lru"),
            ("activated", "c", "device"),
        ]
        tiers = {e.name: e.tiers for e in llm.list_loras()}
    assert tiers == {"a": ["cpu"], "b": ["device", "cpu"], "c": ["device", "cpu"]}


def test_a_full_host_tier_drops_its_least_recently_used_idle_adapter(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]], tmp_path: Path
) -> None:
    a, b, c = requests
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2) as llm:
        llm.generate([PROMPT], GREEDY, lora_request=a)
        llm.generate([PROMPT], GREEDY, lora_request=b)
        _lifecycle(llm)
        # A broken adapter is refused before anything is evicted to make room for it.
        with pytest.raises(ValueError, match=r"adapter_config\.json"):
            llm.engine.call(AddLoRA("broken", str(tmp_path)))
        assert _lifecycle(llm) == []
        # Host: a (off the device, least recently used), b (on it). c pushes a out of the host.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=c)) == [alone["c"]]
        assert _lifecycle(llm) == [
            ("loaded", "c", "cpu"),  # read first: only then does a leave the host tier
            ("evicted", "a", "capacity"),
            ("evicted", "b", "lru"),
            ("activated", "c", "device"),
        ]
        # a is still registered: using it reads it from disk again.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=a)) == [alone["a"]]
        assert [e[:2] for e in _lifecycle(llm)] == [
            ("loaded", "a"),
            ("evicted", "b"),
            ("evicted", "c"),
            ("activated", "a"),
        ]
        # b is now on disk only; unloading it must still reach every API server.
        llm.engine.call(RemoveLoRA("b"))
        assert _lifecycle(llm) == [("evicted", "b", "unload")]
        assert [e.name for e in llm.list_loras()] == ["a", "c"]


def test_a_full_host_tier_keeps_the_adapter_most_asked_for_even_when_least_recently_used(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]]
) -> None:
    """Under skewed traffic the popular adapter is often idle for a moment: least recently
    used alone would push it out for a rarely used one and read it back soon after."""
    a, b, c = requests
    d = LoRARequest("d", a.path)  # a fourth adapter (a's files under another name)
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=3) as llm:
        for _ in range(3):
            llm.generate([PROMPT], GREEDY, lora_request=a)
        llm.generate([PROMPT], GREEDY, lora_request=b)
        llm.generate([PROMPT], GREEDY, lora_request=c)
        _lifecycle(llm)
        # Host: a (3 requests, least recently used), b (1), c (1, on the device). d needs a
        # place: of the idle off-device adapters b was asked for least, so b leaves, not a.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=d)) == [alone["a"]]
        assert _lifecycle(llm) == [
            ("loaded", "d", "cpu"),
            ("evicted", "b", "capacity"),
            ("evicted", "c", "lru"),
            ("activated", "d", "device"),
        ]
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=a)) == [alone["a"]]
        assert [e[:2] for e in _lifecycle(llm)] == [("evicted", "d"), ("activated", "a")]


def test_the_host_tier_counts_only_the_latest_requests_so_it_follows_a_shift_in_popularity(
    tiny_llama_dir: Path,
    requests: list[LoRARequest],
    alone: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter popular an hour ago must not hold its place forever: only the engine's
    latest RECENT_REQUESTS requests count (four here)."""
    from rankcast.engine_core import lora_registry

    monkeypatch.setattr(lora_registry, "RECENT_REQUESTS", 4)
    a, b, c = requests
    d = LoRARequest("d", a.path)
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=3) as llm:
        for r in (a, a, a, b, b, c):  # the latest four: a, b, b, c
            llm.generate([PROMPT], GREEDY, lora_request=r)
        _lifecycle(llm)
        # All six counted, a (3) would stay and b (2) leave; of the latest four, a has one.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=d)) == [alone["a"]]
        assert _lifecycle(llm)[:2] == [("loaded", "d", "cpu"), ("evicted", "a", "capacity")]


def test_a_full_host_tier_evicts_the_idle_adapter_off_the_device_before_the_one_on_it(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]]
) -> None:
    """The adapter in a device slot serves its next request at once; one only in the host
    tier needs a copy to a slot first. So a full host tier gives up the off-device one, even
    when it was asked for more, or as often and more recently: neither popularity nor the
    order adapters came in may push out the one on the device."""
    a, b, c = requests
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2) as llm:
        for r in (b, b, a):
            llm.generate([PROMPT], GREEDY, lora_request=r)
        _lifecycle(llm)
        # Host: b (asked for twice, off the device), a (once, on it). c needs a place.
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=c)) == [alone["c"]]
        assert _lifecycle(llm)[:2] == [("loaded", "c", "cpu"), ("evicted", "b", "capacity")]
    modules = ((a.name, a.path),)
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_modules=modules) as llm:
        llm.engine.call(AddLoRA(b.name, b.path))  # after start-up: more recent than a
        _lifecycle(llm)
        # Host: a (started with, on the device), b (added later, off it); neither asked for.
        assert {e.name: e.tiers for e in llm.list_loras()} == {"a": ["device", "cpu"], "b": ["cpu"]}
        assert _tokens(llm.generate([PROMPT], GREEDY, lora_request=c)) == [alone["c"]]
        assert _lifecycle(llm)[:2] == [("loaded", "c", "cpu"), ("evicted", "b", "capacity")]


def test_every_slot_pinned_refuses_other_adapters_at_submission(
    tiny_llama_dir: Path, requests: list[LoRARequest]
) -> None:
    a, b = requests[:2]
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2) as llm:
        llm.generate([PROMPT], GREEDY, lora_request=a)
        llm.pin_lora("a")
        with pytest.raises(ValueError, match="pinned adapter"):
            llm.generate([PROMPT], GREEDY, lora_request=b)
        llm.pin_lora("a", pinned=False)
        assert len(llm.generate([PROMPT], GREEDY, lora_request=b)) == 1


def test_max_cpu_loras_below_max_loras_is_a_config_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        lora_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=1)


def test_a_busy_adapter_is_drained_for_a_deferred_one_instead_of_starving_it(
    tiny_llama_dir: Path, requests: list[LoRARequest]
) -> None:
    """One slot, a's request running, then b's and another a's arrive. Admitting the second a
    at once would keep the slot busy and b waiting for as long as a's keep coming; instead the
    slot drains: b runs when the first a finishes, the second a after b (without turns: with
    them the first a would be parked for b, tests/engine/test_scheduler_policy.py)."""
    a, b = requests[:2]
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_turn_steps=0) as llm:
        llm.generate([PROMPT], GREEDY, lora_request=a)
        llm.engine.call(AddLoRA(b.name, b.path))
        _lifecycle(llm)
        engine = llm.engine
        first = engine.add_request(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), lora_name="a"
        )
        engine.step()  # a's prefill: a runs
        late_b = engine.add_request(PROMPT, GREEDY, lora_name="b")
        late_a = engine.add_request(PROMPT, GREEDY, lora_name="a")
        order = []
        while engine.has_unfinished_requests():
            order += [o.request_id for o in engine.step() if o.finished]
        assert order == [first, late_b, late_a]
        assert _lifecycle(llm) == [
            ("evicted", "a", "lru"),
            ("activated", "b", "device"),
            ("evicted", "b", "lru"),
            ("activated", "a", "device"),
        ]


def test_an_adapter_whose_files_vanished_fails_its_request_with_the_reason_and_nothing_else(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]], tmp_path: Path
) -> None:
    a, b = requests[:2]
    doomed = tmp_path / "doomed"
    shutil.copytree(a.path, doomed)
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1) as llm:
        llm.engine.call(AddLoRA("doomed", str(doomed)))
        llm.engine.call(
            AddLoRA(b.name, b.path)
        )  # the host tier holds one: doomed is now on disk only
        (doomed / "adapter_model.safetensors").unlink()
        _lifecycle(llm)
        engine = llm.engine  # LLM.generate would re-validate the adapter and fail earlier
        ids = [engine.add_request(PROMPT, GREEDY, lora_name=n) for n in ("doomed", "b")]
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        failed, served = (finished[i] for i in ids)
        events = _lifecycle(llm)
        assert _tokens([served]) == [alone["b"]]
        assert [e.name for e in llm.list_loras()] == ["b"]
    assert failed.outputs[0].finish_reason == "abort" and failed.outputs[0].token_ids == []
    assert failed.error is not None and "adapter_model.safetensors" in failed.error
    failed_at = events.index(("load_failed", "doomed", ""))
    assert events[failed_at + 1] == ("evicted", "doomed", "load_failed")  # tier disk: forgotten
    assert ("evicted", "b", "capacity") not in events, "a failed read evicts nobody"
    assert "unregistered" in failed.error


def test_with_two_slots_the_running_adapter_is_never_the_victim_even_when_least_recent(
    tiny_llama_dir: Path, requests: list[LoRARequest]
) -> None:
    """Two slots: a runs a long request, x is used (and finishes) after a started, so a is the
    least recently used; a request on b must then evict the idle x, never the running a. With
    one slot the scheduler defers before the registry is asked, so only two slots test the
    registry's own rule."""
    a, x, b = requests
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with lora_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=3) as llm:
        want = _tokens(llm.generate([PROMPT], long, lora_request=a))[0]
        for r in (x, b):
            llm.engine.call(AddLoRA(r.name, r.path))
        engine = llm.engine
        running = engine.add_request(PROMPT, long, lora_name="a")
        engine.step()
        quick = engine.add_request(PROMPT, GREEDY, lora_name=x.name)
        outputs: dict[str, object] = {}
        while quick not in outputs:
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        _lifecycle(llm)
        late = engine.add_request(PROMPT, GREEDY, lora_name=b.name)
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        assert _lifecycle(llm) == [("evicted", x.name, "lru"), ("activated", b.name, "device")]
        assert _tokens([outputs[running]]) == [want], "a kept its slot while it ran"
        assert late in outputs


def test_the_host_tier_holds_each_adapter_as_slot_images_not_checkpoint_tensors(
    tiny_llama_dir: Path, requests: list[LoRARequest], alone: dict[str, list[int]]
) -> None:
    """A rank keeps one form of an adapter (what each LoRA layer copies into a slot), so turns
    activate it with a few copies and the tier holds no second copy; answers unchanged."""
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_turn_steps=2) as llm:
        a, b = requests[:2]
        outputs = llm.generate([PROMPT] * 4, GREEDY, lora_request=[a, b, a, b])
        worker = llm.engine.client.core.executor.worker
        keys = {
            (layer, projection.image_key)
            for layer, projections in worker.runner.lora_layers.items()
            for projection in projections
        }
        held = list(worker.loras.host.values())
        assert held and all(not adapter.weights for adapter in held)
        assert all(set(adapter.slot_images) == keys for adapter in held)
    assert _tokens(outputs) == [alone["a"], alone["b"], alone["a"], alone["b"]]


def test_slot_images_made_for_every_layer_at_once_hold_each_layers_own_weights(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The host tier's images are made for all layers of a kind together (stacked); each
    layer's image must still be that layer's A and scaled, transposed B, and zeros (target
    off) for a layer the adapter leaves alone."""
    from safetensors.torch import load_file, save_file

    make_adapter(tiny_llama_dir, tmp_path / "middle", rank=4, alpha=12)
    weights_file = tmp_path / "middle" / "adapter_model.safetensors"
    kept = {  # layer 1 only, and there not k_proj: one fused projection partly targeted
        key: tensor
        for key, tensor in load_file(weights_file).items()
        if ".layers.1." in key and "k_proj" not in key
    }
    save_file(kept, weights_file)
    with lora_llm(tiny_llama_dir, max_loras=1) as llm:
        runner = llm.engine.client.core.executor.worker.runner
        adapter = load_peft_adapter("middle", tmp_path / "middle", runner.arch, 8)
        formed = runner.host_tier_form(adapter)
        seen = set()
        for layer, projections in runner.lora_layers.items():
            for projection in projections:
                image = formed.slot_images[(layer, projection.image_key)]
                for i, sub in enumerate(projection.subs):
                    weights = adapter.weights.get((layer, sub.module))
                    want_a = torch.zeros(projection.max_rank, projection.in_size)
                    want_b = torch.zeros(projection.max_rank, sub.out_size)
                    if weights is not None:
                        want_a[:4] = weights.a
                        want_b[:4] = (weights.b * adapter.scaling).T
                    assert image.targets[i] == (weights is not None)
                    assert torch.equal(image.a[i], want_a), (layer, sub.module)
                    assert torch.equal(image.b[i], want_b), (layer, sub.module)
                    seen.add((layer, weights is not None))
    assert seen == {(0, False), (1, True), (1, False), (2, False)}


def test_an_engine_starts_with_the_first_listed_adapters_in_its_tiers(
    tiny_llama_dir: Path, mixed_adapters: list[Path]
) -> None:
    """--lora-modules are all read as they are registered; the engine then keeps the first
    listed (its host tier the first --max-cpu-loras, its slots the first --max-loras), not
    whichever came last."""
    modules = tuple((f"m{i}", str(path)) for i, path in enumerate(mixed_adapters))
    with lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_modules=modules) as llm:
        tiers = {adapter.name: adapter.tiers for adapter in llm.list_loras()}
    assert tiers == {"m0": ["device", "cpu"], "m1": ["cpu"], "m2": []}
