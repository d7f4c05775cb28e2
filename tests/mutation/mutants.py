"""One small mutation per rule of the notification contract and of the adapter cache (and a few
engine rules they rest on), each with the tests that must fail when it is applied.

docs/rules-and-tests.md is the same list as a table; `make mutants` (tests/mutation/run.py)
applies each mutation, runs only its tests, reverts it and says CAUGHT or SURVIVED.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    path: str
    original: str  # must occur exactly once in the file
    mutated: str
    tests: tuple[str, ...]


NOTIFY = "tests/test_notifications.py"
GATHER = "tests/engine/test_notification_gather.py"
SERVED = "tests/entrypoints/test_server_notifications.py"
CACHE = "tests/lora/test_lora_cache.py"
VLLM_KV = "tests/routing/test_vllm_kv_events.py"
ROUTER = "tests/routing/test_engine_router.py"
ROUTED = "tests/routing/test_engine_routing_served.py"

MUTANTS = [
    # ---- the notification contract (docs/architecture.md, rules 1-10) ----
    Mutant(
        "publish-skips-payload-check",
        "1 Publish validates the payload at the producer",
        "rankcast/channel/validation.py",
        '        _check_value(n.payload, "payload")',
        "        pass",
        (NOTIFY,),
    ),
    Mutant(
        "buffer-drops-newest",
        "2 A full buffer drops the oldest event",
        "rankcast/channel/buffer.py",
        "        lost = self._items.popleft()",
        "        lost = self._items.pop()",
        (NOTIFY,),
    ),
    Mutant(
        "drop-marker-last",
        "3 Drops are reported at the head of the drained batch",
        "rankcast/channel/buffer.py",
        "            items.insert(0, marker)",
        "            items.append(marker)",
        (NOTIFY,),
    ),
    Mutant(
        "gather-first-rank-only",
        "4 Gather keeps every rank's events",
        "rankcast/channel/gather.py",
        "        for rank, batch in enumerate(batches):",
        "        for rank, batch in enumerate(batches[:1]):",
        (GATHER,),
    ),
    Mutant(
        "gather-swaps-rank-stamps",
        "4 Gather stamps each event with its source ranks",
        "rankcast/channel/gather.py",
        "                n.pp_rank, n.tp_rank, n.rank = pp_rank, tp_rank, rank",
        "                n.pp_rank, n.tp_rank, n.rank = tp_rank, pp_rank, rank",
        (GATHER,),
    ),
    Mutant(
        "gather-reverses-rank-order",
        "4 Gather concatenates in rank order",
        "rankcast/channel/gather.py",
        "        for rank, batch in enumerate(batches):",
        "        for rank, batch in reversed(list(enumerate(batches))):",
        (GATHER,),
    ),
    Mutant(
        "doorbell-ignored",
        "5 An idle engine gathers when a rank rang its doorbell",
        "rankcast/channel/gather.py",
        "self.use_doorbell and self.executor.notifications_pending()",
        "False",
        (GATHER,),
    ),
    Mutant(
        "step-reply-events-dropped",
        "5 Each rank's events ride its reply to the step",
        "rankcast/engine_core/core.py",
        "            self.notifications.receive(result.notifications)",
        "            pass",
        (GATHER,),
    ),
    Mutant(
        "step-reply-without-events",
        "3, 5 A rank drains its buffer into its step reply",
        "rankcast/worker/worker.py",
        "        return StepReply(output, notifications, reads)",
        "        return StepReply(output, None, reads)",
        (GATHER,),
    ),
    Mutant(
        "drain-leaves-doorbell-rung",
        "5 A rank's drain clears its doorbell (no gather for delivered events)",
        "rankcast/channel/buffer.py",
        "                self._doorbell.clear(self._rank)",
        "                pass",
        (GATHER,),
    ),
    Mutant(
        "engine-list-unbounded",
        "6 The engine's pending list is bounded, drops counted",
        "rankcast/channel/gather.py",
        "            self.pending.popleft()",
        "            pass",
        (GATHER,),
    ),
    Mutant(
        "engine-seq-gaps",
        "6 Flush stamps a gap-free engine_seq",
        "rankcast/channel/gather.py",
        "            self.next_engine_seq += 1",
        "            self.next_engine_seq += 2",
        (GATHER, SERVED),
    ),
    Mutant(
        "broadcast-to-one-server",
        "7 Every API server receives every notification",
        "rankcast/engine_core/core.py",
        "engine_notifications=notifications,",
        "engine_notifications=notifications if client == 0 else None,",
        (SERVED,),
    ),
    Mutant(
        "snapshot-seq-off-by-one",
        "8 A late API server continues exactly after its snapshot",
        "rankcast/channel/gather.py",
        "        return self.next_engine_seq - 1",
        "        return self.next_engine_seq",
        (SERVED,),
    ),
    Mutant(
        "unknown-type-fatal",
        "9 Unknown notification types are counted and skipped",
        "rankcast/channel/decoder.py",
        "                    unknown.append(self._tag_decoder.decode(raw).type)",
        "                    raise",
        (NOTIFY,),
    ),
    Mutant(
        "kv-removals-unpublished",
        "10 Engine-level producers: KV-cache events describe the cache exactly",
        "rankcast/engine_core/block_manager.py",
        "                        self._removed.append(block.block_hash)",
        "                        pass",
        ("tests/engine/test_kv_events.py",),
    ),
    Mutant(
        "kv-incarnation-not-cleared",
        "12 vLLM-format KV events: AllBlocksCleared is every incarnation's first event",
        "rankcast/engine_core/block_manager.py",
        "[KVCacheCleared()] if self.kv_events else []\n\n    def blocks_for",
        "[]\n\n    def blocks_for",
        (VLLM_KV,),
    ),
    Mutant(
        "kv-events-as-arrays",
        "12 vLLM-format KV events: each event is a map tagged with its type",
        "rankcast/channel/vllm_kv_events.py",
        "class VLLMKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):",
        "class VLLMKVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):",
        (VLLM_KV,),
    ),
    Mutant(
        "kv-seq-continues-across-publishers",
        "12 vLLM-format KV events: seq counts from 0 in each publisher process",
        "rankcast/channel/sequenced_publisher.py",
        "        self.seq = -1\n",
        "        self.seq = int(time.time()) % 1000\n",
        (VLLM_KV,),
    ),
    Mutant(
        "kv-dp-rank-unstamped",
        "12 vLLM-format KV events: each engine's batches carry its DP rank",
        "rankcast/channel/vllm_kv_events.py",
        "[to_vllm(e) for e in events], self.engine_index)",
        "[to_vllm(e) for e in events], 0)",
        (VLLM_KV,),
    ),
    Mutant(
        "render-without-template",
        "12 Render answers the token ids the engine computes",
        "rankcast/entrypoints/openai/discovery.py",
        "    token_ids = chat_prompt_ids(ctx, body)\n",
        "    token_ids = ctx.tokenizer.encode(body.messages[-1].text())\n",
        (VLLM_KV,),
    ),
    Mutant(
        "routing-ignores-prefix",
        "13 Routing: the engine caching a request's prefix wins over load alone",
        "rankcast/engine_client/engine_router.py",
        "        cached = self._prefix(engine, prompt, lora_name) if self.uses_prefix else 0\n",
        "        cached = 0\n",
        (ROUTER, ROUTED),
    ),
    Mutant(
        "routing-ignores-adapter",
        "13 Routing: the engine holding an adapter in a device slot wins over load alone",
        "rankcast/engine_client/engine_router.py",
        "            adapter = ADAPTER_COST[self.residency.tier_on(engine, lora_name)]",
        "            adapter = 0",
        (ROUTER, ROUTED),
    ),
    Mutant(
        "routing-ignores-load",
        "13 Routing: load holds back an engine that holds every prefix",
        "rankcast/engine_client/engine_router.py",
        "        return uncached, adapter, LOAD_COST * requests, room",
        "        return uncached, adapter, 0, room",
        (ROUTER,),
    ),
    Mutant(
        "event-ids-without-incarnation",
        "11 Event ids carry the engine core's incarnation",
        "rankcast/entrypoints/openai/events.py",
        '        return f"{self.engine}:{self.incarnation}:{self.seq}"',
        '        return f"{self.engine}:0:{self.seq}"',
        ("tests/entrypoints/test_events.py",),
    ),
    Mutant(
        "restart-not-announced",
        "11 A resume from an older incarnation gets a replay_gap",
        "rankcast/entrypoints/openai/events.py",
        "        if incarnation != current:",
        "        if False:",
        ("tests/entrypoints/test_events.py",),
    ),
    Mutant(
        "kv-cache-left-to-first-use",
        "A rank's KV cache memory is taken at start",
        "rankcast/worker/model_runner.py",
        "    tensor.view(-1).view(torch.uint8)[:: mmap.PAGESIZE].zero_()",
        "    pass",
        ("tests/worker/test_kv_memory.py",),
    ),
    Mutant(
        "ping-without-deadline",
        "A rank on a host that is cut off is found lost within seconds",
        "rankcast/executor/ray_executor.py",
        "_PING_TIMEOUT_S = 2.5",
        "_PING_TIMEOUT_S = 30.0",
        ("tests/reliability/test_ray_netns.py",),
    ),
    Mutant(
        "engine-last-words-lost",
        "/health names why an engine core died (its last words reach the supervisor)",
        "rankcast/engine_core/core_proc.py",
        '                    last_words.send(("failed", str(exc).split("\\n", 1)[0]))',
        "                    pass",
        ("tests/reliability/test_ray_netns.py",),
    ),
    Mutant(
        "launcher-leaves-children",
        "The launcher returns only after every process it started has been reaped",
        "rankcast/entrypoints/launcher.py",
        "        reap_everything()",
        "        pass",
        ("tests/reliability/test_nothing_left_behind.py",),
    ),
    Mutant(
        "dead-engine-not-restarted",
        "11 A dead engine core is started again under its next incarnation",
        "rankcast/entrypoints/launcher.py",
        "        if not state.due() or stop_requested.is_set():",
        "        if True:",
        ("tests/reliability/test_engine_give_up.py",),
    ),
    # ---- the adapter cache ----
    Mutant(
        "evicts-running-adapter",
        "An adapter a running request uses is never evicted",
        "rankcast/engine_core/lora_registry.py",
        "            if a.slot is not None and not a.pinned and a.name not in busy",
        "            if a.slot is not None and not a.pinned",
        (CACHE,),
    ),
    Mutant(
        "evicts-pinned-adapter",
        "A pinned adapter is never evicted",
        "rankcast/engine_core/lora_registry.py",
        "            if a.slot is not None and not a.pinned and a.name not in busy",
        "            if a.slot is not None and a.name not in busy",
        (CACHE,),
    ),
    Mutant(
        "evicts-most-recent",
        "The least recently used idle adapter leaves a device slot",
        "rankcast/engine_core/lora_registry.py",
        "        return min(idle, key=lambda a: a.last_used, default=None)",
        "        return max(idle, key=lambda a: a.last_used, default=None)",
        (CACHE,),
    ),
    Mutant(
        "adapter-reads-ignored",
        "An adapter is ready once every rank read it, from the step's typed results",
        "rankcast/engine_core/core.py",
        "                self.loras.update_from_reads(result.adapter_reads)",
        "                pass",
        ("tests/lora/test_background_read.py",),
    ),
    Mutant(
        "host-tier-unbounded",
        "A full host tier drops its least recently used idle adapter",
        "rankcast/engine_core/lora_registry.py",
        "        if len(held) < self.config.host_capacity:",
        "        if True:",
        (CACHE,),
    ),
    Mutant(
        "batch-adapters-untracked",
        "A batch never holds more distinct adapters than slots",
        "rankcast/engine_core/scheduler.py",
        "                active.add(request.lora_name)",
        "                pass",
        (CACHE,),
    ),
    Mutant(
        "no-drain",
        "A deferred adapter gets a slot drained for it",
        "rankcast/engine_core/scheduler.py",
        "                        self.draining = self._drain_target(running)",
        "                        self.draining = None",
        (CACHE,),
    ),
    Mutant(
        "lora-scaling-ignores-rank",
        "Adapter deltas are scaled by alpha / r",
        "rankcast/lora/peft_adapter.py",
        'alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank',
        'alpha / math.sqrt(rank) if config.get("use_rslora") else alpha',
        ("tests/lora/test_peft_adapter.py",),
    ),
    # ---- engine rules the two rest on ----
    Mutant(
        "greedy-picks-argmin",
        "Greedy sampling takes the most likely token",
        "rankcast/worker/sampler.py",
        "        return ops.argmax(logits).tolist(), None",
        "        return logits.argmin(dim=-1).tolist(), None",
        ("tests/engine/test_llm.py",),
    ),
    Mutant(
        "kv-slot-shifted",
        "Each token's K/V goes to its own cache slot",
        "rankcast/worker/model_runner.py",
        "slots.extend(blocks[p // bs] * bs + p % bs for p in range(first, first + n))",
        "slots.extend(blocks[p // bs] * bs + (p + 1) % bs for p in range(first, first + n))",
        ("tests/model/test_llama_logits.py",),
    ),
    Mutant(
        "prefix-hit-covers-last-token",
        "A prefix-cache hit never covers a prompt's last token",
        "rankcast/engine_core/block_manager.py",
        "        for name in self._hashes(request, (request.num_tokens - 1) // self.block_size):",
        "        for name in self._hashes(request, request.num_tokens // self.block_size):",
        ("tests/engine/test_cache_rules.py",),
    ),
    Mutant(
        "block-hash-ignores-parent",
        "A block's cache identity chains its parent's",
        "rankcast/engine_core/block_manager.py",
        "block_hash(hashes[-1] if hashes else None, tokens, request.lora_id)",
        "block_hash(None, tokens, request.lora_id)",
        ("tests/engine/test_cache_rules.py",),
    ),
    Mutant(
        "reused-block-stays-free",
        "A cached block a request reuses leaves the free queue while held",
        "rankcast/engine_core/block_manager.py",
        "                del self.free_blocks[block_id]",
        "                pass",
        ("tests/engine/test_cache_rules.py",),
    ),
    Mutant(
        "stored-event-parent-lost",
        "A kv_blocks_stored event names as parent the block just before its first block",
        "rankcast/engine_core/block_manager.py",
        "                parent_block_hash=hashes[first - 1] if first else None,",
        "                parent_block_hash=None,",
        ("tests/engine/test_cache_rules.py",),
    ),
    Mutant(
        "engine-totals-reset-on-restart",
        "Engine-total counters never go backwards across an engine restart",
        "rankcast/metrics/prometheus.py",
        "            totals.incarnation, totals.base = snapshot.incarnation, dict(totals.shown)",
        "            totals.incarnation = snapshot.incarnation",
        ("tests/entrypoints/test_server_metrics.py", "tests/reliability/test_engine_restart.py"),
    ),
    Mutant(
        "prefix-cache-ignores-adapter",
        "A cached block is reused only under the adapter that computed it",
        "rankcast/engine_core/block_manager.py",
        "block_hash(hashes[-1] if hashes else None, tokens, request.lora_id)",
        "block_hash(hashes[-1] if hashes else None, tokens, 0)",
        ("tests/engine/test_scheduler.py",),
    ),
    Mutant(
        "token-mask-not-applied",
        "A structured request samples only tokens its shape allows",
        "rankcast/worker/grammar.py",
        "        ops.apply_token_bitmask(logits, self.rows, self.bitmask)",
        "        pass",
        ("tests/worker/test_structured_outputs.py",),
    ),
    Mutant(
        "mask-before-raw-logprobs",
        "Logprobs are the raw model's, taken before the structured mask",
        "rankcast/worker/sampler.py",
        "    raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None\n"
        "    if allowed is not None:\n"
        "        allowed.apply(logits)\n",
        "    if allowed is not None:\n"
        "        allowed.apply(logits)\n"
        "    raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None\n",
        ("tests/worker/test_structured_outputs.py",),
    ),
]
