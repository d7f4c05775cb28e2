//! The LoRA series of `/metrics`, written line for line as the Python servers' `LoRAMetrics`
//! writes them: the lifecycle event counter and the load-time histogram (both starting from the
//! snapshot's totals, so a late server reports what its siblings report), then the residency
//! families, read at scrape time from `loras::Residency` so a series disappears the moment its
//! eviction arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::EngineStateSnapshot;

use crate::exposition::{format_value, write_header, write_sample};
use crate::loras::Residency;

const LOAD_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
const EVENTS: &str = "rankcast:lora_adapter_events_total";
const LOAD_SECONDS: &str = "vllm:lora_adapter_load_seconds";

/// One histogram child: per-bucket counts (not cumulative), count and sum.
#[derive(Default)]
struct Histogram {
    buckets: [f64; LOAD_BUCKETS.len() + 1],
    count: f64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        let bucket = LOAD_BUCKETS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(LOAD_BUCKETS.len());
        self.buckets[bucket] += 1.0;
        self.count += 1.0;
        self.sum += seconds;
    }
}

#[derive(Default)]
struct Counts {
    /// (adapter, event, reason) -> events: this server's view of the engine's totals.
    events: BTreeMap<(String, String, String), f64>,
    /// transition -> load times, children in the order first observed (prometheus_client's).
    loads: Vec<(String, Histogram)>,
}

impl Counts {
    fn event(&mut self, adapter: &str, event: &str, reason: &str, count: f64) {
        let key = (adapter.to_string(), event.to_string(), reason.to_string());
        *self.events.entry(key).or_default() += count;
    }

    fn load(&mut self, transition: &str, seconds: f64) {
        let index = match self.loads.iter().position(|(t, _)| t == transition) {
            Some(index) => index,
            None => {
                self.loads
                    .push((transition.to_string(), Histogram::default()));
                self.loads.len() - 1
            }
        };
        self.loads[index].1.observe(seconds);
    }
}

pub struct LoRAMetrics {
    model: String,
    counts: Mutex<Counts>,
}

/// vLLM's `level` label calls the device tier "gpu" whatever the device is.
fn level(tier: &str) -> &str {
    if tier == "device" {
        "gpu"
    } else {
        tier
    }
}

impl LoRAMetrics {
    pub fn new(model: &str) -> LoRAMetrics {
        LoRAMetrics {
            model: model.to_string(),
            counts: Mutex::new(Counts::default()),
        }
    }

    pub fn apply_snapshot(&self, snapshot: &EngineStateSnapshot) {
        let Some(lora) = &snapshot.lora else { return };
        let mut counts = self.counts.lock().expect("lora metrics lock");
        for c in &lora.events {
            counts.event(&c.adapter, &c.event, &c.reason, c.count as f64);
        }
        for load in &lora.loads {
            counts.load(&load.transition, load.seconds);
        }
    }

    /// Count the lifecycle events (by adapter, event, reason) and time the moves into a tier.
    pub fn consume(&self, notifications: &[Notification]) {
        let mut counts = self.counts.lock().expect("lora metrics lock");
        for n in notifications {
            match n {
                Notification::LoRALoaded(l) => {
                    counts.event(&l.adapter_name, "loaded", "", 1.0);
                    let into = if l.tier == "device" { "gpu" } else { &l.tier };
                    counts.load(&format!("disk_to_{into}"), l.seconds);
                }
                Notification::LoRAActivated(a) => {
                    counts.event(&a.adapter_name, "activated", "", 1.0);
                    counts.load("cpu_to_gpu", a.seconds);
                }
                Notification::LoRAEvicted(e) => {
                    counts.event(&e.adapter_name, "evicted", &e.reason, 1.0);
                }
                Notification::LoRAPinned(p) => counts.event(&p.adapter_name, "pinned", "", 1.0),
                Notification::LoRAUnpinned(u) => {
                    counts.event(&u.adapter_name, "unpinned", "", 1.0);
                }
                Notification::LoRALoadFailed(f) => {
                    counts.event(&f.adapter_name, "load_failed", "", 1.0);
                }
                _ => {}
            }
        }
    }

    /// Every LoRA family, in the Python servers' order; the residency ones only when the
    /// engine serves adapters (its snapshot had a LoRA section).
    pub fn render(&self, out: &mut String, residency: &Residency) {
        self.render_counts(out);
        if residency.max_loras > 0 {
            self.render_residency(out, residency);
        }
    }

    fn render_counts(&self, out: &mut String) {
        let counts = self.counts.lock().expect("lora metrics lock");
        write_header(
            out,
            EVENTS,
            "Adapter lifecycle events from every rank, by adapter, event and reason.",
            "counter",
        );
        for ((adapter, event, reason), value) in &counts.events {
            let labels = [
                ("adapter_name", adapter.clone()),
                ("event", event.clone()),
                ("reason", reason.clone()),
            ];
            write_sample(out, EVENTS, &labels, *value);
        }
        write_header(
            out,
            LOAD_SECONDS,
            "Seconds a rank took to move an adapter, per transition (one per rank per move).",
            "histogram",
        );
        for (transition, h) in &counts.loads {
            let mut cumulative = 0.0;
            let bounds = LOAD_BUCKETS.iter().map(|b| format_value(*b));
            for (bound, n) in bounds.chain(["+Inf".to_string()]).zip(h.buckets) {
                cumulative += n;
                let labels = [("le", bound), ("transition", transition.clone())];
                write_sample(out, &format!("{LOAD_SECONDS}_bucket"), &labels, cumulative);
            }
            let labels = [("transition", transition.clone())];
            write_sample(out, &format!("{LOAD_SECONDS}_count"), &labels, h.count);
            write_sample(out, &format!("{LOAD_SECONDS}_sum"), &labels, h.sum);
        }
    }

    fn render_residency(&self, out: &mut String, residency: &Residency) {
        let model = &self.model;
        let name = "vllm:lora_adapter_loaded";
        write_header(
            out,
            name,
            "1 while the adapter is resident on the rank (series removed on eviction).",
            "gauge",
        );
        let mut resident: BTreeMap<&str, BTreeSet<(i64, &str)>> = BTreeMap::new();
        for (engine, adapters) in &residency.adapters {
            for (adapter, state) in adapters {
                for (rank, tiers) in &state.ranks {
                    let pinned = state.pinned.contains(rank);
                    for tier in tiers {
                        let level = level(tier);
                        resident
                            .entry(level)
                            .or_default()
                            .insert((*engine, adapter));
                        let labels = [
                            ("adapter_name", adapter.clone()),
                            ("level", level.to_string()),
                            ("pinned", pinned.to_string()),
                            ("rank", rank.to_string()),
                            ("model_name", model.clone()),
                            ("engine", engine.to_string()),
                        ];
                        write_sample(out, name, &labels, 1.0);
                    }
                }
            }
        }
        for level in ["gpu", "cpu"] {
            let name = format!("vllm:num_{level}_loaded_lora_adapters");
            let help = format!("Adapters resident in the {level} tier (per engine, counted once).");
            write_header(out, &name, &help, "gauge");
            let count = resident.get(level).map_or(0, BTreeSet::len);
            write_sample(out, &name, &[("model_name", model.clone())], count as f64);
        }
        let name = "vllm:max_gpu_lora_adapters";
        write_header(out, name, "Adapter slots per rank (--max-loras).", "gauge");
        let slots = residency.max_loras as f64;
        write_sample(out, name, &[("model_name", model.clone())], slots);
        let name = "rankcast:lora_adapter_partial";
        write_header(
            out,
            name,
            "1 when the ranks of an engine that holds the adapter disagree on where it is.",
            "gauge",
        );
        for adapter in residency.names() {
            let partial = f64::from(u8::from(residency.partial(&adapter)));
            write_sample(out, name, &[("adapter_name", adapter)], partial);
        }
        let name = "vllm:lora_requests_info";
        write_header(
            out,
            name,
            "Adapters of running and of waiting requests; value: unix time of the last change.",
            "gauge",
        );
        let labels = [
            ("max_lora", residency.max_loras.to_string()),
            (
                "running_lora_adapters",
                residency.running_adapters().join(","),
            ),
            (
                "waiting_lora_adapters",
                residency.waiting_adapters().join(","),
            ),
        ];
        write_sample(out, name, &labels, residency.requests_changed_at());
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn an_observation_lands_in_the_first_bucket_at_or_above_it() {
        let mut h = Histogram::default();
        h.observe(0.001); // on a bound: that bucket (le is "less or equal")
        h.observe(0.3);
        h.observe(11.0);
        assert_eq!(h.buckets[0], 1.0);
        assert_eq!(h.buckets[7], 1.0); // 0.5
        assert_eq!(h.buckets[12], 1.0); // +Inf
        assert_eq!(h.count, 3.0);
        assert!((h.sum - 11.301).abs() < 1e-12);
    }
}
