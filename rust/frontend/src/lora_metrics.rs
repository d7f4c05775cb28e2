//! The LoRA series of `/metrics`, written line for line as the Python servers' `LoRAMetrics`
//! writes them, rendered from the engine views (`engine_views`); nothing here counts events. The
//! lifecycle event counter shows every engine's total (earlier incarnations included), the
//! load-time histogram observes each load the views applied once, and the residency families
//! are read at scrape time, so a series disappears the moment its eviction arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use rankcast_frontend::engine_views::{LoadsFollowed, Views};

use crate::exposition::{format_value, write_header, write_sample};

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

/// The load-time histogram and how far it has followed each view's loads.
#[derive(Default)]
struct Loads {
    /// transition -> load times, children in the order first observed (prometheus_client's).
    histograms: Vec<(String, Histogram)>,
    followed: LoadsFollowed,
}

impl Loads {
    fn observe(&mut self, transition: &str, seconds: f64) {
        let index = match self.histograms.iter().position(|(t, _)| t == transition) {
            Some(index) => index,
            None => {
                self.histograms
                    .push((transition.to_string(), Histogram::default()));
                self.histograms.len() - 1
            }
        };
        self.histograms[index].1.observe(seconds);
    }
}

pub struct LoRAMetrics {
    model: String,
    loads: Mutex<Loads>,
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
            loads: Mutex::new(Loads::default()),
        }
    }

    /// Observe the load times the views applied since the last call, each once.
    pub fn follow_loads(&self, views: &Views) {
        let mut loads = self.loads.lock().expect("lora metrics lock");
        let new = views.new_loads(&mut loads.followed);
        for (transition, seconds) in new {
            loads.observe(&transition, seconds);
        }
    }

    /// Every LoRA family, in the Python servers' order; the residency ones only when an
    /// engine serves adapters (its snapshot had a LoRA section).
    pub fn render(&self, out: &mut String, views: &Views) {
        self.render_counts(out, views);
        if views.serves_adapters() {
            self.render_residency(out, views);
        }
    }

    fn render_counts(&self, out: &mut String, views: &Views) {
        write_header(
            out,
            EVENTS,
            "Adapter lifecycle events from every rank, by adapter, event and reason.",
            "counter",
        );
        for ((adapter, event, reason), value) in views.lora_event_totals() {
            let labels = [
                ("adapter_name", adapter),
                ("event", event),
                ("reason", reason),
            ];
            write_sample(out, EVENTS, &labels, value as f64);
        }
        write_header(
            out,
            LOAD_SECONDS,
            "Seconds a rank took to move an adapter, per transition (one per rank per move).",
            "histogram",
        );
        let loads = self.loads.lock().expect("lora metrics lock");
        for (transition, h) in &loads.histograms {
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

    fn render_residency(&self, out: &mut String, views: &Views) {
        let model = &self.model;
        let name = "vllm:lora_adapter_loaded";
        write_header(
            out,
            name,
            "1 while the adapter is resident on the rank (series removed on eviction).",
            "gauge",
        );
        let mut resident: BTreeMap<&str, BTreeSet<(i64, &str)>> = BTreeMap::new();
        for (engine, view) in &views.views {
            for (adapter, state) in &view.adapters {
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
        let slots = views.max_loras() as f64;
        write_sample(out, name, &[("model_name", model.clone())], slots);
        let name = "rankcast:lora_adapter_partial";
        write_header(
            out,
            name,
            "1 when the ranks of an engine that holds the adapter disagree on where it is.",
            "gauge",
        );
        for adapter in views.adapter_names() {
            let partly = views.views.values().any(|v| v.partial(&adapter));
            write_sample(
                out,
                name,
                &[("adapter_name", adapter)],
                f64::from(u8::from(partly)),
            );
        }
        let name = "vllm:lora_requests_info";
        write_header(
            out,
            name,
            "Adapters of running and of waiting requests; value: unix time of the last change.",
            "gauge",
        );
        let labels = [
            ("max_lora", views.max_loras().to_string()),
            ("running_lora_adapters", views.running_adapters().join(",")),
            ("waiting_lora_adapters", views.waiting_adapters().join(",")),
        ];
        write_sample(out, name, &labels, views.requests_changed_at());
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
