//! Which LoRA adapters the engine has registered, as every API server learns it: from the
//! snapshot's LoRA section, then from the lifecycle notifications (the same rules as the Python
//! servers' `LoRAResidency`: a load or an activation registers the adapter on a rank's tier; an
//! eviction takes the tier away, all of the rank's for the host tier; an unload or a failed load
//! that leaves no rank holding it forgets it). A request names an adapter in `model`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::EngineStateSnapshot;

/// rank -> tiers, per adapter name.
type Residency = BTreeMap<String, BTreeMap<i64, BTreeSet<String>>>;

#[derive(Default)]
pub struct Adapters {
    registered: Mutex<Residency>,
}

impl Adapters {
    pub fn apply_snapshot(&self, snapshot: &EngineStateSnapshot) {
        let Some(lora) = &snapshot.lora else { return };
        let mut registered = self.registered.lock().expect("adapters lock");
        registered.clear();
        for adapter in &lora.adapters {
            let ranks = registered.entry(adapter.name.clone()).or_default();
            for held in &adapter.ranks {
                ranks
                    .entry(held.rank)
                    .or_default()
                    .insert(held.tier.clone());
            }
        }
    }

    pub fn consume(&self, notifications: &[Notification]) {
        let mut registered = self.registered.lock().expect("adapters lock");
        for n in notifications {
            match n {
                Notification::LoRALoaded(l) => {
                    let ranks = registered.entry(l.adapter_name.clone()).or_default();
                    ranks.entry(l.rank).or_default().insert(l.tier.clone());
                }
                Notification::LoRAActivated(a) => {
                    let ranks = registered.entry(a.adapter_name.clone()).or_default();
                    ranks.entry(a.rank).or_default().insert(a.tier.clone());
                }
                Notification::LoRAEvicted(e) => {
                    let Some(ranks) = registered.get_mut(&e.adapter_name) else {
                        continue;
                    };
                    if let Some(tiers) = ranks.get_mut(&e.rank) {
                        tiers.remove(&e.tier);
                        if e.tier == "cpu" {
                            tiers.clear(); // the host tier holds everything the rank had
                        }
                        if tiers.is_empty() {
                            ranks.remove(&e.rank);
                        }
                    }
                    let forgotten = matches!(e.reason.as_str(), "unload" | "load_failed");
                    if forgotten && ranks.is_empty() {
                        registered.remove(&e.adapter_name);
                    }
                }
                _ => {}
            }
        }
    }

    /// Registered adapters, in name order (servable by name).
    pub fn names(&self) -> Vec<String> {
        self.registered
            .lock()
            .expect("adapters lock")
            .keys()
            .cloned()
            .collect()
    }
}
