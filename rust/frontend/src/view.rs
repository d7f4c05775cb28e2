//! One engine's state as its notifications describe it: the `EngineView`, kept the same way by
//! every process that follows an engine. This is the Python `EngineView`
//! (`rankcast/channel/view.py`) field for field and rule for rule; its module docstring states
//! the rules once, and both languages replay the golden streams in `tests/fixtures/view/` (this
//! module's tests, and `tests/test_engine_view.py`) and must end in the states written there.
//!
//! Every event type has one handler (the one `match` in `EngineView::handle`); every event also
//! counts in the totals (by type and, for `custom`, key) and, for a LoRA lifecycle event, in the
//! adapter event counter, by the keys of `rankcast/channel/lora_events.py`. Of the custom events,
//! a rank's weight load is kept as it last reported it, and its expert load added to its tokens
//! per (layer, expert) (`read_expert_load`, `rankcast/channel/expert_load.py`'s rule). The rules
//! of residency:
//!
//! - a load or an activation puts the adapter in that rank's tier ("cpu" host tier, "device"
//!   slot);
//! - an eviction takes the tier away; from the host tier it takes everything the rank held and
//!   the rank's pin with it; a device eviction keeps the pin;
//! - an unload or a failed load (`reason` "unload"/"load_failed") that leaves no rank holding
//!   the adapter forgets it; any other eviction leaves it registered with no tier;
//! - a pin or an unpin changes that rank's pin; a failed load changes nothing but the counts.
//!
//! `as_json` is what `/v1/engine_views` serves and the dashboard renders: the same values as the
//! Python view's (object keys come out in name order here, in insertion order there).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rankcast_client::wire::codec::read_array_len;
use rankcast_client::wire::notifications::{
    KVBlocksRemoved, KVBlocksStored, LoRAAdapterEvicted, Notification, NotificationLedgerState,
    NotificationTotal, RankCount, RankExpertTokens, RankWeightsLoaded,
};
use rankcast_client::wire::protocol::{
    AdapterResidency, EngineStateSnapshot, KVCacheBlock, KVCacheState, LoRAEventCount,
    LoRALoadTime, LoRAState, RankTier,
};
use rankcast_client::wire::{Dict, Result, Value, Wire};
use serde_json::{json, Map, Value as Json};

/// Load-time observations kept for a late API server's histogram (oldest forgotten first).
pub const LOADS_KEPT: usize = 10_000;
/// The key of the in-tree producer that reports each rank's weight-load time.
pub const WEIGHTS_LOADED_KEY: &str = "rankcast.weights_loaded";
/// The key of the ranks' expert-load events (`rankcast/channel/expert_load.py`).
pub const EXPERT_LOAD_KEY: &str = "rankcast.expert_load";

/// (layer, tokens per expert) for each row of an expert-load payload; None when it is not one:
/// `layers` a list of integers >= 0, `tokens` as many lists of integers >= 0 (below 2**63). The
/// Python view reads by the same rule (`read_expert_load`).
pub fn read_expert_load(payload: &Dict<Value>) -> Option<Vec<(i64, Vec<i64>)>> {
    let count = |value: &Value| match value {
        Value::Int(v) => i64::try_from(*v).ok().filter(|v| *v >= 0),
        _ => None,
    };
    let (Some(Value::Array(layers)), Some(Value::Array(tokens))) =
        (payload.get("layers"), payload.get("tokens"))
    else {
        return None;
    };
    if layers.len() != tokens.len() {
        return None;
    }
    let rows = layers.iter().zip(tokens).map(|(layer, row)| {
        let Value::Array(row) = row else { return None };
        let counts: Option<Vec<i64>> = row.iter().map(count).collect();
        Some((count(layer)?, counts?))
    });
    rows.collect()
}

/// Add `counts` to `into` place by place, `into` growing to the longer of the two.
pub fn add_counts(into: &mut Vec<i64>, counts: &[i64]) {
    if into.len() < counts.len() {
        into.resize(counts.len(), 0);
    }
    for (total, count) in into.iter_mut().zip(counts) {
        *total = total.saturating_add(*count);
    }
}

/// Tier order wherever tiers are listed: the device first, as the one requests run on, then the
/// host tier, then any other in name order.
pub fn ordered_tiers<'a>(tiers: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    let rank = |tier: &str| match tier {
        "device" => 0,
        "cpu" => 1,
        _ => 2,
    };
    let mut out: Vec<String> = tiers.into_iter().cloned().collect();
    out.sort_by(|a, b| (rank(a), a).cmp(&(rank(b), b)));
    out.dedup();
    out
}

/// What the engine's configuration says about adapters (not events): ranks, slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoRAShape {
    pub world_size: i64,
    pub max_loras: i64,
    pub max_cpu_loras: i64,
}

/// One registered adapter: its engine id, the tiers each rank holds it in, which ranks pinned
/// it. Evicted from every tier it stays registered (it loads again on demand).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterView {
    pub adapter_id: i64,
    pub ranks: BTreeMap<i64, BTreeSet<String>>,
    pub pinned: BTreeSet<i64>,
}

impl Default for AdapterView {
    fn default() -> Self {
        AdapterView::new(-1)
    }
}

impl AdapterView {
    pub fn new(adapter_id: i64) -> AdapterView {
        AdapterView {
            adapter_id,
            ranks: BTreeMap::new(),
            pinned: BTreeSet::new(),
        }
    }

    /// The tiers of each rank in `0..world_size` (empty where a rank holds nothing).
    pub fn tiers_of(&self, world_size: i64) -> Vec<BTreeSet<String>> {
        (0..world_size)
            .map(|rank| self.ranks.get(&rank).cloned().unwrap_or_default())
            .collect()
    }
}

/// One cached block as the KV-cache events described it.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexedBlock {
    pub parent: Option<i64>,
    pub token_ids: Vec<i64>,
    pub lora_id: i64,
}

/// An engine's prefix-cache index rebuilt from its KV-cache events
/// (`rankcast/channel/kv_index.py`'s `KVCacheIndex`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KVCacheIndex {
    pub blocks: BTreeMap<i64, IndexedBlock>,
    /// Blocks that start a sequence (no parent): how many distinct prefixes are held.
    pub roots: i64,
}

impl KVCacheIndex {
    /// A sliding-window group's blocks (`group_idx` 1) stay out: the index mirrors the full
    /// group's, which prefixes are matched on (as `kv_index.py`'s `apply`).
    fn stored(&mut self, n: &KVBlocksStored) {
        if n.group_idx != 0 {
            return;
        }
        let size = n.block_size.max(0) as usize;
        for (i, name) in n.block_hashes.iter().enumerate() {
            let parent = if i == 0 {
                n.parent_block_hash
            } else {
                Some(n.block_hashes[i - 1])
            };
            let start = (i * size).min(n.token_ids.len());
            let end = ((i + 1) * size).min(n.token_ids.len());
            let block = IndexedBlock {
                parent,
                token_ids: n.token_ids[start..end].to_vec(),
                lora_id: n.lora_id,
            };
            // A block stored again replaces what was held: a root counts once, as held now.
            if let Some(old) = self.blocks.insert(*name, block) {
                if old.parent.is_none() {
                    self.roots -= 1;
                }
            }
            if parent.is_none() {
                self.roots += 1;
            }
        }
    }

    fn removed(&mut self, n: &KVBlocksRemoved) {
        if n.group_idx != 0 {
            return;
        }
        for name in &n.block_hashes {
            if let Some(gone) = self.blocks.remove(name) {
                if gone.parent.is_none() {
                    self.roots -= 1;
                }
            }
        }
    }

    fn cleared(&mut self) {
        self.blocks.clear();
        self.roots = 0;
    }

    /// The snapshot section: every block, in name order.
    pub fn state(&self, block_size: i64) -> KVCacheState {
        KVCacheState {
            block_size,
            blocks: self
                .blocks
                .iter()
                .map(|(name, b)| KVCacheBlock {
                    block_hash: *name,
                    parent: b.parent,
                    token_ids: b.token_ids.clone(),
                    lora_id: b.lora_id,
                })
                .collect(),
        }
    }

    pub fn from_state(state: &KVCacheState) -> KVCacheIndex {
        let mut index = KVCacheIndex::default();
        for block in &state.blocks {
            let indexed = IndexedBlock {
                parent: block.parent,
                token_ids: block.token_ids.clone(),
                lora_id: block.lora_id,
            };
            index.blocks.insert(block.block_hash, indexed);
            index.roots += i64::from(block.parent.is_none());
        }
        index
    }
}

/// (adapter, event, reason) of a LoRA lifecycle event, the labels of its event counter; None
/// for other types (`lora_event_key` in `rankcast/channel/lora_events.py`).
pub fn lora_event_key(n: &Notification) -> Option<(String, String, String)> {
    let (adapter, event, reason) = match n {
        Notification::LoRALoaded(l) => (&l.adapter_name, "loaded", ""),
        Notification::LoRAActivated(a) => (&a.adapter_name, "activated", ""),
        Notification::LoRAEvicted(e) => (&e.adapter_name, "evicted", e.reason.as_str()),
        Notification::LoRAPinned(p) => (&p.adapter_name, "pinned", ""),
        Notification::LoRAUnpinned(u) => (&u.adapter_name, "unpinned", ""),
        Notification::LoRALoadFailed(f) => (&f.adapter_name, "load_failed", ""),
        _ => return None,
    };
    Some((adapter.clone(), event.to_string(), reason.to_string()))
}

/// (transition, seconds) when the event is a timed move into a tier; None otherwise. vLLM's
/// metric names call the device tier "gpu" whatever the device is.
pub fn lora_load_time(n: &Notification) -> Option<(String, f64)> {
    match n {
        Notification::LoRALoaded(l) => {
            let into = if l.tier == "device" { "gpu" } else { &l.tier };
            Some((format!("disk_to_{into}"), l.seconds))
        }
        Notification::LoRAActivated(a) => Some(("cpu_to_gpu".to_string(), a.seconds)),
        _ => None,
    }
}

/// One engine's adapters per rank and tier, pins, KV index, incarnation, weight loads and event
/// counters, from its snapshot and events; running and waiting requests per adapter from its
/// stats.
#[derive(Debug, Clone)]
pub struct EngineView {
    pub engine_index: i64,
    pub incarnation: i64,
    /// The last event applied (the largest `engine_seq` seen).
    pub engine_seq: i64,
    pub lora: Option<LoRAShape>,
    pub adapters: BTreeMap<String, AdapterView>,
    pub lora_events: BTreeMap<(String, String, String), i64>,
    pub loads: VecDeque<(String, f64)>,
    /// Every load ever applied (renderers observe the new ones).
    pub loads_applied: u64,
    /// Adapter ids learned from stored blocks of adapters this view does not hold.
    pub block_lora_ids: BTreeMap<String, i64>,
    pub kv_block_size: Option<i64>,
    pub kv: KVCacheIndex,
    pub totals: BTreeMap<(String, String), i64>,
    pub dropped: BTreeMap<i64, i64>,
    pub weights_loaded: BTreeMap<i64, Dict<Value>>,
    /// (rank, layer) -> tokens routed to each expert (index) in this incarnation.
    pub expert_tokens: BTreeMap<(i64, i64), Vec<i64>>,
    /// Types this process could not decode (a newer engine's): counted, not engine state.
    pub skipped: BTreeMap<String, i64>,
    /// From the engine's stats: requests per adapter that run (parked included) and wait, and
    /// the engine-clock time either set last changed.
    pub running: BTreeMap<String, i64>,
    pub waiting: BTreeMap<String, i64>,
    pub requests_changed_at: f64,
}

impl Default for EngineView {
    fn default() -> Self {
        EngineView::new(0, 0, None, None)
    }
}

impl EngineView {
    pub fn new(
        engine_index: i64,
        incarnation: i64,
        lora: Option<LoRAShape>,
        kv_block_size: Option<i64>,
    ) -> EngineView {
        EngineView {
            engine_index,
            incarnation,
            engine_seq: -1,
            lora,
            adapters: BTreeMap::new(),
            lora_events: BTreeMap::new(),
            loads: VecDeque::new(),
            loads_applied: 0,
            block_lora_ids: BTreeMap::new(),
            kv_block_size,
            kv: KVCacheIndex::default(),
            totals: BTreeMap::new(),
            dropped: BTreeMap::new(),
            weights_loaded: BTreeMap::new(),
            expert_tokens: BTreeMap::new(),
            skipped: BTreeMap::new(),
            running: BTreeMap::new(),
            waiting: BTreeMap::new(),
            requests_changed_at: 0.0,
        }
    }

    // ---- inputs ----

    /// One event, through its type's handler; every event counts in the totals. An event of a
    /// type this build does not know goes to `apply_unknown`.
    pub fn apply(&mut self, n: &Notification) {
        let Some(engine_seq) = n.engine_seq() else {
            self.apply_unknown(&n.type_name());
            return;
        };
        self.engine_seq = self.engine_seq.max(engine_seq);
        let key = match n {
            Notification::Custom(c) => c.key.clone(),
            _ => String::new(),
        };
        *self.totals.entry((n.type_name(), key)).or_default() += 1;
        if let Some(key) = lora_event_key(n) {
            *self.lora_events.entry(key).or_default() += 1;
        }
        if let Some(load) = lora_load_time(n) {
            self.push_load(load);
            self.loads_applied += 1;
        }
        self.handle(n);
    }

    /// An event of a type this process cannot decode: counted, then skipped.
    pub fn apply_unknown(&mut self, type_name: &str) {
        *self
            .totals
            .entry((type_name.to_string(), String::new()))
            .or_default() += 1;
        *self.skipped.entry(type_name.to_string()).or_default() += 1;
    }

    /// Start over from the engine's snapshot (a first connection, or a new incarnation).
    pub fn apply_snapshot(&mut self, snapshot: &EngineStateSnapshot) {
        *self = EngineView::new(snapshot.engine_index, snapshot.incarnation, None, None);
        self.engine_seq = snapshot.engine_seq;
        let ledger = &snapshot.notifications;
        for total in &ledger.totals {
            let key = (total.r#type.clone(), total.key.clone());
            self.totals.insert(key, total.count);
        }
        for dropped in &ledger.dropped {
            self.dropped.insert(dropped.rank, dropped.count);
        }
        for weights in &ledger.weights_loaded {
            self.weights_loaded
                .insert(weights.rank, weights.payload.clone());
        }
        for experts in &ledger.expert_tokens {
            self.expert_tokens
                .insert((experts.rank, experts.layer), experts.tokens.clone());
        }
        if let Some(lora) = &snapshot.lora {
            self.lora = Some(LoRAShape {
                world_size: lora.world_size,
                max_loras: lora.max_loras,
                max_cpu_loras: lora.max_cpu_loras,
            });
            for a in &lora.adapters {
                let mut adapter = AdapterView::new(a.id);
                for held in &a.ranks {
                    adapter
                        .ranks
                        .entry(held.rank)
                        .or_default()
                        .insert(held.tier.clone());
                }
                adapter.pinned = a.pinned_ranks.iter().copied().collect();
                self.adapters.insert(a.name.clone(), adapter);
            }
            for c in &lora.events {
                let key = (c.adapter.clone(), c.event.clone(), c.reason.clone());
                self.lora_events.insert(key, c.count);
            }
            for load in &lora.loads {
                self.push_load((load.transition.clone(), load.seconds));
            }
            self.loads_applied = self.loads.len() as u64;
        }
        if let Some(kv) = &snapshot.kv_cache {
            self.kv_block_size = Some(kv.block_size);
            self.kv = KVCacheIndex::from_state(kv);
        }
    }

    /// The engine's stats: requests per adapter, and when those sets last changed.
    pub fn record_requests(&mut self, running: &Dict<i64>, waiting: &Dict<i64>, changed_at: f64) {
        let counts = |d: &Dict<i64>| d.0.iter().map(|(k, v)| (k.clone(), *v)).collect();
        self.running = counts(running);
        self.waiting = counts(waiting);
        self.requests_changed_at = changed_at;
    }

    fn push_load(&mut self, load: (String, f64)) {
        if self.loads.len() == LOADS_KEPT {
            self.loads.pop_front();
        }
        self.loads.push_back(load);
    }

    // ---- handlers: one arm per event type ----

    fn handle(&mut self, n: &Notification) {
        match n {
            Notification::LoRALoaded(l) => {
                self.held(&l.adapter_name, l.adapter_id, l.rank, &l.tier);
            }
            Notification::LoRAActivated(a) => {
                self.held(&a.adapter_name, a.adapter_id, a.rank, &a.tier);
            }
            Notification::LoRAEvicted(e) => self.evicted(e),
            Notification::LoRAPinned(p) => {
                if let Some(adapter) = self.adapters.get_mut(&p.adapter_name) {
                    adapter.pinned.insert(p.rank);
                }
            }
            Notification::LoRAUnpinned(u) => {
                if let Some(adapter) = self.adapters.get_mut(&u.adapter_name) {
                    adapter.pinned.remove(&u.rank);
                }
            }
            // Nothing the rank held changed (the engine's eviction with "load_failed" follows).
            Notification::LoRALoadFailed(_) => {}
            Notification::KVStored(s) => {
                self.kv.stored(s);
                if let Some(name) = &s.lora_name {
                    self.block_lora_ids.insert(name.clone(), s.lora_id);
                }
            }
            Notification::KVRemoved(r) => self.kv.removed(r),
            Notification::KVCleared(_) => self.kv.cleared(),
            Notification::Dropped(d) => *self.dropped.entry(d.rank).or_default() += d.count,
            Notification::Custom(c) => {
                if c.key == WEIGHTS_LOADED_KEY {
                    self.weights_loaded.insert(c.rank, c.payload.clone());
                } else if c.key == EXPERT_LOAD_KEY {
                    for (layer, tokens) in read_expert_load(&c.payload).unwrap_or_default() {
                        let into = self.expert_tokens.entry((c.rank, layer)).or_default();
                        add_counts(into, &tokens);
                    }
                }
            }
            Notification::Unknown(_) => {} // counted by `apply_unknown`
        }
    }

    fn held(&mut self, name: &str, adapter_id: i64, rank: i64, tier: &str) {
        let adapter = self.adapters.entry(name.to_string()).or_default();
        adapter.adapter_id = adapter_id;
        adapter
            .ranks
            .entry(rank)
            .or_default()
            .insert(tier.to_string());
    }

    fn evicted(&mut self, n: &LoRAAdapterEvicted) {
        let Some(adapter) = self.adapters.get_mut(&n.adapter_name) else {
            return;
        };
        let mut tiers = adapter.ranks.remove(&n.rank).unwrap_or_default();
        tiers.remove(&n.tier);
        if n.tier == "cpu" {
            tiers.clear(); // the host tier holds everything: nothing is left on the rank
            adapter.pinned.remove(&n.rank);
        }
        if !tiers.is_empty() {
            adapter.ranks.insert(n.rank, tiers);
        }
        let forgotten = matches!(n.reason.as_str(), "unload" | "load_failed");
        if forgotten && adapter.ranks.is_empty() {
            self.adapters.remove(&n.adapter_name); // the engine forgot it
        }
    }

    // ---- reading ----

    /// The engine's registration id of an adapter (block names include it).
    pub fn adapter_id(&self, name: &str) -> Option<i64> {
        match self.adapters.get(name) {
            Some(adapter) if adapter.adapter_id >= 0 => Some(adapter.adapter_id),
            _ => self.block_lora_ids.get(name).copied(),
        }
    }

    pub fn world_size(&self, adapter: &AdapterView) -> i64 {
        match self.lora {
            Some(lora) => lora.world_size,
            None => adapter.ranks.keys().next_back().map_or(-1, |r| *r) + 1,
        }
    }

    /// Where a request on `name` finds it: "device" when every rank holds it in a device slot,
    /// "cpu" when every rank holds it at least in its host tier, None otherwise (partial
    /// residency means some rank must load it).
    pub fn tier_on(&self, name: &str) -> Option<&'static str> {
        let adapter = self.adapters.get(name)?;
        let held = adapter.tiers_of(self.world_size(adapter));
        if held.is_empty() {
            return None;
        }
        if held.iter().all(|tiers| tiers.contains("device")) {
            return Some("device");
        }
        if held.iter().all(|tiers| !tiers.is_empty()) {
            return Some("cpu");
        }
        None
    }

    /// Whether the ranks disagree on where the adapter is, or on its pin.
    pub fn partial(&self, name: &str) -> bool {
        let Some(adapter) = self.adapters.get(name) else {
            return false;
        };
        let world = self.world_size(adapter);
        let distinct: BTreeSet<BTreeSet<String>> = adapter.tiers_of(world).into_iter().collect();
        let pins = adapter.pinned.len() as i64;
        distinct.len() > 1 || (0 < pins && pins < world)
    }

    /// Adapters pinned on some rank and held in some rank's device slot, in name order.
    pub fn pinned_in_device(&self) -> Vec<String> {
        self.adapters
            .iter()
            .filter(|(_, a)| {
                !a.pinned.is_empty() && a.ranks.values().any(|tiers| tiers.contains("device"))
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The catch-up snapshot: everything above but the stats and the skipped types.
    pub fn state(&self) -> EngineStateSnapshot {
        let lora = self.lora.map(|shape| LoRAState {
            world_size: shape.world_size,
            max_loras: shape.max_loras,
            max_cpu_loras: shape.max_cpu_loras,
            adapters: self
                .adapters
                .iter()
                .map(|(name, a)| AdapterResidency {
                    name: name.clone(),
                    id: a.adapter_id,
                    pinned: !a.pinned.is_empty(),
                    ranks: a
                        .ranks
                        .iter()
                        .flat_map(|(rank, tiers)| {
                            ordered_tiers(tiers)
                                .into_iter()
                                .map(|tier| RankTier { rank: *rank, tier })
                        })
                        .collect(),
                    pinned_ranks: a.pinned.iter().copied().collect(),
                })
                .collect(),
            events: self
                .lora_events
                .iter()
                .map(|((adapter, event, reason), count)| LoRAEventCount {
                    adapter: adapter.clone(),
                    event: event.clone(),
                    reason: reason.clone(),
                    count: *count,
                })
                .collect(),
            loads: self
                .loads
                .iter()
                .map(|(transition, seconds)| LoRALoadTime {
                    transition: transition.clone(),
                    seconds: *seconds,
                })
                .collect(),
        });
        EngineStateSnapshot {
            engine_index: self.engine_index,
            engine_seq: self.engine_seq,
            notifications: NotificationLedgerState {
                totals: self
                    .totals
                    .iter()
                    .map(|((kind, key), count)| NotificationTotal {
                        r#type: kind.clone(),
                        key: key.clone(),
                        count: *count,
                    })
                    .collect(),
                dropped: self
                    .dropped
                    .iter()
                    .map(|(rank, count)| RankCount {
                        rank: *rank,
                        count: *count,
                    })
                    .collect(),
                weights_loaded: self
                    .weights_loaded
                    .iter()
                    .map(|(rank, payload)| RankWeightsLoaded {
                        rank: *rank,
                        payload: payload.clone(),
                    })
                    .collect(),
                expert_tokens: self
                    .expert_tokens
                    .iter()
                    .map(|((rank, layer), tokens)| RankExpertTokens {
                        rank: *rank,
                        layer: *layer,
                        tokens: tokens.clone(),
                    })
                    .collect(),
            },
            lora,
            kv_cache: self.kv_block_size.map(|size| self.kv.state(size)),
            incarnation: self.incarnation,
        }
    }

    /// The view as the page and `/v1/engine_views` show it (the Python server's is the same):
    /// named fields, adapters with their ranks, the KV index as counts, not blocks.
    pub fn as_json(&self) -> Json {
        let lora = self.lora.map_or(Json::Null, |shape| {
            let adapters: Vec<Json> = self
                .adapters
                .iter()
                .map(|(name, a)| {
                    let ranks: BTreeSet<i64> =
                        a.ranks.keys().chain(a.pinned.iter()).copied().collect();
                    let ranks: Vec<Json> = ranks
                        .into_iter()
                        .map(|rank| {
                            let tiers = a.ranks.get(&rank).map(ordered_tiers).unwrap_or_default();
                            json!({"rank": rank, "tiers": tiers, "pinned": a.pinned.contains(&rank)})
                        })
                        .collect();
                    json!({
                        "name": name,
                        "id": a.adapter_id,
                        "ranks": ranks,
                        "tier": self.tier_on(name),
                        "partial": self.partial(name),
                        "running_requests": self.running.get(name).copied().unwrap_or(0),
                        "waiting_requests": self.waiting.get(name).copied().unwrap_or(0),
                    })
                })
                .collect();
            let events: Vec<Json> = self
                .lora_events
                .iter()
                .map(|((adapter, event, reason), count)| {
                    json!({"adapter": adapter, "event": event, "reason": reason, "count": count})
                })
                .collect();
            let last_load = self.loads.back().map_or(Json::Null, |(transition, seconds)| {
                json!({"transition": transition, "seconds": seconds})
            });
            json!({
                "world_size": shape.world_size,
                "max_loras": shape.max_loras,
                "max_cpu_loras": shape.max_cpu_loras,
                "adapters": adapters,
                "events": events,
                "last_load": last_load,
                "running": self.running,
                "waiting": self.waiting,
            })
        });
        let totals: Vec<Json> = self
            .totals
            .iter()
            .map(|((kind, key), count)| json!({"type": kind, "key": key, "count": count}))
            .collect();
        let dropped: Vec<Json> = self
            .dropped
            .iter()
            .map(|(rank, count)| json!({"rank": rank, "count": count}))
            .collect();
        let weights: Vec<Json> = self
            .weights_loaded
            .iter()
            .map(|(rank, payload)| json!({"rank": rank, "payload": dict_json(payload)}))
            .collect();
        let experts: Vec<Json> = self
            .expert_tokens
            .iter()
            .map(|((rank, layer), tokens)| json!({"rank": rank, "layer": layer, "tokens": tokens}))
            .collect();
        let kv_cache = self.kv_block_size.map_or(Json::Null, |size| {
            json!({"block_size": size, "blocks": self.kv.blocks.len(), "prefixes": self.kv.roots})
        });
        json!({
            "engine": self.engine_index,
            "incarnation": self.incarnation,
            "engine_seq": self.engine_seq,
            "notifications": {"totals": totals, "dropped": dropped, "weights_loaded": weights},
            "experts": experts,
            "lora": lora,
            "kv_cache": kv_cache,
        })
    }
}

/// A msgpack value as JSON, as Python's `json.dumps` writes what msgspec decoded: integers stay
/// integers, map keys become strings.
pub fn value_json(value: &Value) -> Json {
    match value {
        Value::Nil => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(v) => {
            if let Ok(v) = i64::try_from(*v) {
                Json::from(v)
            } else if let Ok(v) = u64::try_from(*v) {
                Json::from(v)
            } else {
                Json::from(*v as f64)
            }
        }
        Value::Float(v) => Json::from(*v),
        Value::Str(s) => Json::String(s.clone()),
        Value::Bin(bytes) => Json::from(bytes.clone()),
        Value::Array(items) => Json::Array(items.iter().map(value_json).collect()),
        Value::Map(items) => {
            let mut map = Map::new();
            for (k, v) in items {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    Value::Nil => "null".to_string(),
                    other => value_json(other).to_string(),
                };
                map.insert(key, value_json(v));
            }
            Json::Object(map)
        }
    }
}

fn dict_json(dict: &Dict<Value>) -> Json {
    let mut map = Map::new();
    for (k, v) in &dict.0 {
        map.insert(k.clone(), value_json(v)); // a repeated key: the last one, as in a dict
    }
    Json::Object(map)
}

/// One replay case, `[snapshot, [event, ...]]`: the engine's catch-up snapshot as it crosses the
/// wire and the notification maps that follow it (`tests/fixtures/view/generate.py`).
pub fn decode_case(rd: &mut &[u8]) -> Result<(EngineStateSnapshot, Vec<Notification>)> {
    let length = read_array_len(rd)?;
    if length != 2 {
        return rankcast_client::wire::codec::fail(format!(
            "a case is [snapshot, events]: {length} items"
        ));
    }
    let snapshot = EngineStateSnapshot::decode(rd)?;
    let events = Vec::<Notification>::decode(rd)?;
    Ok((snapshot, events))
}

/// A fresh view after `snapshot` and then every event.
pub fn replay(snapshot: &EngineStateSnapshot, events: &[Notification]) -> EngineView {
    let mut view = EngineView::default();
    view.apply_snapshot(snapshot);
    for n in events {
        view.apply(n);
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankcast_client::wire::notifications::{
        LoRAAdapterActivated, LoRAAdapterLoaded, LoRAAdapterPinned,
    };
    use rankcast_client::wire::{from_bytes, to_bytes};
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/view")
    }

    fn cases() -> Vec<(String, EngineStateSnapshot, Vec<Notification>)> {
        let mut names: Vec<String> = std::fs::read_dir(fixtures())
            .expect("tests/fixtures/view")
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                Some(name.strip_suffix(".msgpack")?.to_string())
            })
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let bytes = std::fs::read(fixtures().join(format!("{name}.msgpack"))).unwrap();
                let mut rd = bytes.as_slice();
                let (snapshot, events) =
                    decode_case(&mut rd).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(rd.is_empty(), "{name}: bytes after the case");
                (name, snapshot, events)
            })
            .collect()
    }

    #[test]
    fn every_golden_stream_ends_in_the_state_python_wrote() {
        let cases = cases();
        let names: Vec<&str> = cases.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["kv_blocks", "lora_tp2", "restarted"]);
        for (name, snapshot, events) in &cases {
            let text = std::fs::read_to_string(fixtures().join(format!("{name}.json"))).unwrap();
            let want: Json = serde_json::from_str(&text).unwrap();
            let got = replay(snapshot, events).as_json();
            assert_eq!(
                got,
                want,
                "{name}: the Rust view ends elsewhere:\n{}",
                serde_json::to_string_pretty(&got).unwrap()
            );
        }
    }

    #[test]
    fn a_view_started_from_its_own_state_is_the_same_view() {
        for (name, snapshot, events) in cases() {
            let view = replay(&snapshot, &events);
            let state = view.state();
            let again: EngineStateSnapshot = from_bytes(&to_bytes(&state)).unwrap();
            let mut copy = EngineView::default();
            copy.apply_snapshot(&again);
            assert_eq!(copy.as_json(), view.as_json(), "{name}");
            assert_eq!(copy.state(), state, "{name}");
        }
    }

    fn loaded(name: &str, rank: i64, tier: &str) -> Notification {
        Notification::LoRALoaded(LoRAAdapterLoaded {
            adapter_name: name.into(),
            adapter_id: 1,
            tier: tier.into(),
            seconds: 0.5,
            seq: 0,
            timestamp: 0.0,
            engine_seq: 3,
            engine_index: 0,
            dp_rank: 0,
            pp_rank: 0,
            tp_rank: rank,
            rank,
        })
    }

    #[test]
    fn residency_and_pins_per_rank() {
        let mut view = EngineView::new(
            0,
            0,
            Some(LoRAShape {
                world_size: 2,
                max_loras: 1,
                max_cpu_loras: 2,
            }),
            None,
        );
        view.apply(&loaded("a", 0, "cpu"));
        assert_eq!(view.tier_on("a"), None, "rank 1 holds nothing");
        assert!(view.partial("a"));
        view.apply(&loaded("a", 1, "cpu"));
        assert_eq!(view.tier_on("a"), Some("cpu"));
        for rank in [0, 1] {
            view.apply(&Notification::LoRAActivated(LoRAAdapterActivated {
                adapter_name: "a".into(),
                adapter_id: 1,
                tier: "device".into(),
                seconds: 0.25,
                slot: 0,
                seq: 0,
                timestamp: 0.0,
                engine_seq: 4,
                engine_index: 0,
                dp_rank: 0,
                pp_rank: 0,
                tp_rank: rank,
                rank,
            }));
        }
        assert_eq!(view.tier_on("a"), Some("device"));
        view.apply(&Notification::LoRAPinned(LoRAAdapterPinned {
            adapter_name: "a".into(),
            adapter_id: 1,
            tier: "device".into(),
            seq: 0,
            timestamp: 0.0,
            engine_seq: 5,
            engine_index: 0,
            dp_rank: 0,
            pp_rank: 0,
            tp_rank: 0,
            rank: 0,
        }));
        assert!(view.partial("a"), "one rank of two pinned it");
        assert_eq!(view.pinned_in_device(), ["a"]);
        assert_eq!(view.engine_seq, 5);
        assert_eq!(view.loads_applied, 4);
        assert_eq!(view.loads.back().unwrap().0, "cpu_to_gpu");
        assert_eq!(view.adapter_id("a"), Some(1));
        let unknown = Notification::Unknown(Value::Map(vec![(
            Value::Str("type".into()),
            Value::Str("kv_future".into()),
        )]));
        view.apply(&unknown);
        assert_eq!(view.skipped["kv_future"], 1);
        assert_eq!(view.totals[&("kv_future".into(), String::new())], 1);
        assert_eq!(
            view.engine_seq, 5,
            "an unknown type is not a place in the stream"
        );
    }

    #[test]
    fn the_load_times_keep_the_latest_ones() {
        let mut view = EngineView::default();
        for _ in 0..LOADS_KEPT + 5 {
            view.apply(&loaded("a", 0, "device"));
        }
        assert_eq!(view.loads.len(), LOADS_KEPT);
        assert_eq!(view.loads_applied, (LOADS_KEPT + 5) as u64);
        assert_eq!(view.loads[0].0, "disk_to_gpu");
    }

    #[test]
    fn tiers_are_listed_device_first() {
        let tiers: BTreeSet<String> = ["cpu", "device", "disk"].map(String::from).into();
        assert_eq!(ordered_tiers(&tiers), ["device", "cpu", "disk"]);
    }
}
