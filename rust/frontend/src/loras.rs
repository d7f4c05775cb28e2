//! What this API server knows about LoRA adapters, as every API server learns it: from the
//! snapshot's LoRA section, the lifecycle notifications and the scheduler stats, never by
//! asking the engine. The rules are the Python servers' `LoRAResidency`: a load or an activation
//! puts the adapter in a rank's tier; an eviction takes the tier away (all of the rank's for the
//! host tier, which holds everything the rank had); an unload or a failed load that leaves no
//! rank holding it forgets it. A request names an adapter in `model`; `/metrics` renders its
//! series from this state (`lora_metrics`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineStateSnapshot, SchedulerStats};
use rankcast_client::wire::Dict;

/// One registered adapter on one engine: the tiers each rank holds it in, and which ranks
/// pinned it. Evicted from every tier it stays registered (it loads again on demand).
#[derive(Default, Clone)]
pub struct AdapterOnEngine {
    pub ranks: BTreeMap<i64, BTreeSet<String>>,
    pub pinned: BTreeSet<i64>,
}

/// Per engine, per adapter: tiers and pins; per engine: the adapters of running and of
/// waiting requests and when that last changed.
#[derive(Default)]
pub struct Residency {
    pub adapters: BTreeMap<i64, BTreeMap<String, AdapterOnEngine>>,
    pub world_size: BTreeMap<i64, i64>,
    pub max_loras: i64,
    pub running: BTreeMap<i64, Dict<i64>>,
    pub waiting: BTreeMap<i64, Dict<i64>>,
    pub changed_at: BTreeMap<i64, f64>,
}

impl Residency {
    fn apply_snapshot(&mut self, snapshot: &EngineStateSnapshot) {
        let Some(lora) = &snapshot.lora else { return };
        let engine = snapshot.engine_index;
        self.world_size.insert(engine, lora.world_size);
        self.max_loras = self.max_loras.max(lora.max_loras);
        let mut adapters = BTreeMap::new();
        for a in &lora.adapters {
            let mut state = AdapterOnEngine::default();
            for held in &a.ranks {
                state
                    .ranks
                    .entry(held.rank)
                    .or_default()
                    .insert(held.tier.clone());
            }
            if a.pinned {
                state.pinned = state.ranks.keys().copied().collect();
            }
            adapters.insert(a.name.clone(), state);
        }
        self.adapters.insert(engine, adapters);
    }

    fn consume(&mut self, n: &Notification) {
        match n {
            Notification::LoRALoaded(l) => {
                self.held(l.engine_index, &l.adapter_name, l.rank, &l.tier);
            }
            Notification::LoRAActivated(a) => {
                self.held(a.engine_index, &a.adapter_name, a.rank, &a.tier);
            }
            Notification::LoRAEvicted(e) => {
                let Some(adapters) = self.adapters.get_mut(&e.engine_index) else {
                    return;
                };
                let Some(state) = adapters.get_mut(&e.adapter_name) else {
                    return;
                };
                if let Some(tiers) = state.ranks.get_mut(&e.rank) {
                    tiers.remove(&e.tier);
                    if e.tier == "cpu" {
                        tiers.clear();
                    }
                    if tiers.is_empty() {
                        state.ranks.remove(&e.rank);
                    }
                }
                if e.tier == "cpu" {
                    state.pinned.remove(&e.rank);
                }
                let forgotten = matches!(e.reason.as_str(), "unload" | "load_failed");
                if forgotten && state.ranks.is_empty() {
                    adapters.remove(&e.adapter_name);
                }
            }
            Notification::LoRAPinned(p) => {
                if let Some(state) = self.state(p.engine_index, &p.adapter_name) {
                    state.pinned.insert(p.rank);
                }
            }
            Notification::LoRAUnpinned(u) => {
                if let Some(state) = self.state(u.engine_index, &u.adapter_name) {
                    state.pinned.remove(&u.rank);
                }
            }
            _ => {}
        }
    }

    fn held(&mut self, engine: i64, name: &str, rank: i64, tier: &str) {
        let state = self
            .adapters
            .entry(engine)
            .or_default()
            .entry(name.to_string())
            .or_default();
        state
            .ranks
            .entry(rank)
            .or_default()
            .insert(tier.to_string());
    }

    fn state(&mut self, engine: i64, name: &str) -> Option<&mut AdapterOnEngine> {
        self.adapters.get_mut(&engine)?.get_mut(name)
    }

    /// Registered adapters, in name order (servable by name).
    pub fn names(&self) -> Vec<String> {
        let names: BTreeSet<&String> = self.adapters.values().flat_map(|a| a.keys()).collect();
        names.into_iter().cloned().collect()
    }

    /// Adapters of running requests on any engine, in name order.
    pub fn running_adapters(&self) -> Vec<String> {
        union_of_keys(&self.running)
    }

    pub fn waiting_adapters(&self) -> Vec<String> {
        union_of_keys(&self.waiting)
    }

    /// When some engine's running or waiting adapter set last changed (engine clock).
    pub fn requests_changed_at(&self) -> f64 {
        self.changed_at.values().copied().fold(0.0, f64::max)
    }

    /// Whether the ranks of an engine that holds `name` disagree on where it is (or on the pin).
    pub fn partial(&self, name: &str) -> bool {
        self.adapters.iter().any(|(engine, adapters)| {
            let Some(state) = adapters.get(name) else {
                return false;
            };
            let last = state.ranks.keys().next_back().map_or(-1, |r| *r);
            let world = self.world_size.get(engine).copied().unwrap_or(last + 1);
            let empty = BTreeSet::new();
            let held: BTreeSet<&BTreeSet<String>> = (0..world)
                .map(|rank| state.ranks.get(&rank).unwrap_or(&empty))
                .collect();
            let pins = state.pinned.len() as i64;
            held.len() > 1 || (0 < pins && pins < world)
        })
    }
}

fn union_of_keys(per_engine: &BTreeMap<i64, Dict<i64>>) -> Vec<String> {
    let names: BTreeSet<&String> = per_engine
        .values()
        .flat_map(|c| c.0.iter().map(|(name, _)| name))
        .collect();
    names.into_iter().cloned().collect()
}

/// The residency behind a lock: the engine thread writes it, requests and scrapes read it.
#[derive(Default)]
pub struct Adapters {
    state: Mutex<Residency>,
}

impl Adapters {
    pub fn apply_snapshot(&self, snapshot: &EngineStateSnapshot) {
        self.lock().apply_snapshot(snapshot);
    }

    pub fn consume(&self, notifications: &[Notification]) {
        let mut state = self.lock();
        for n in notifications {
            state.consume(n);
        }
    }

    pub fn record_stats(&self, engine: i64, stats: &SchedulerStats) {
        let mut state = self.lock();
        state
            .running
            .insert(engine, stats.running_lora_requests.clone());
        state
            .waiting
            .insert(engine, stats.waiting_lora_requests.clone());
        state
            .changed_at
            .insert(engine, stats.lora_requests_changed_at);
    }

    pub fn names(&self) -> Vec<String> {
        self.lock().names()
    }

    /// Read the whole state at once (a scrape renders every LoRA series from one view).
    pub fn read<R>(&self, view: impl FnOnce(&Residency) -> R) -> R {
        view(&self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Residency> {
        self.state.lock().expect("adapters lock")
    }
}
