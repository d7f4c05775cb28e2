//! The LoRA series of `/metrics`, written line for line as the Python servers' `LoRAMetrics`
//! writes them, rendered from the engine views (`engine_views`); nothing here counts events. The
//! lifecycle event counter shows every engine's total (earlier incarnations included), the
//! load-time histogram observes each load the views applied once, and the residency families
//! are read at scrape time, so a series disappears the moment its eviction arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use rankcast_frontend::engine_views::{LoadsFollowed, Views};

use crate::exposition::{format_value, write_sample};
use crate::families::{self, Family};

/// One histogram child: per-bucket counts (not cumulative, `+Inf` last), count and sum.
struct Histogram {
    buckets: Vec<f64>,
    count: f64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Histogram {
        Histogram {
            buckets: vec![0.0; bounds.len() + 1],
            count: 0.0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, bounds: &[f64], seconds: f64) {
        let bucket = bounds
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(bounds.len());
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
    fn observe(&mut self, bounds: &[f64], transition: &str, seconds: f64) {
        let index = match self.histograms.iter().position(|(t, _)| t == transition) {
            Some(index) => index,
            None => {
                let histogram = Histogram::new(bounds);
                self.histograms.push((transition.to_string(), histogram));
                self.histograms.len() - 1
            }
        };
        self.histograms[index].1.observe(bounds, seconds);
    }
}

/// The LoRA families, looked up in the declaration (`families`) when the server starts.
struct Declared {
    events: &'static Family,
    load_seconds: &'static Family,
    loaded: &'static Family,
    /// `vllm:num_{level}_loaded_lora_adapters`, by level.
    resident: [(&'static str, &'static Family); 2],
    slots: &'static Family,
    partial: &'static Family,
    requests_info: &'static Family,
}

impl Declared {
    fn look_up() -> Declared {
        let resident = |level| {
            let family = families::gauge(&format!("vllm:num_{level}_loaded_lora_adapters"));
            (level, family)
        };
        Declared {
            events: families::counter("rankcast:lora_adapter_events"),
            load_seconds: families::histogram("vllm:lora_adapter_load_seconds"),
            loaded: families::gauge("vllm:lora_adapter_loaded"),
            resident: [resident("gpu"), resident("cpu")],
            slots: families::gauge("vllm:max_gpu_lora_adapters"),
            partial: families::gauge("rankcast:lora_adapter_partial"),
            requests_info: families::gauge("vllm:lora_requests_info"),
        }
    }
}

pub struct LoRAMetrics {
    model: String,
    families: Declared,
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
            families: Declared::look_up(),
            loads: Mutex::new(Loads::default()),
        }
    }

    /// Observe the load times the views applied since the last call, each once.
    pub fn follow_loads(&self, views: &Views) {
        let mut loads = self.loads.lock().expect("lora metrics lock");
        let new = views.new_loads(&mut loads.followed);
        let bounds = &self.families.load_seconds.buckets;
        for (transition, seconds) in new {
            loads.observe(bounds, &transition, seconds);
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
        let events = self.families.events;
        events.write_header(out);
        for ((adapter, event, reason), value) in views.lora_event_totals() {
            let labels = events.labelled([adapter, event, reason]);
            write_sample(out, &events.name, &labels, value as f64);
        }
        let family = self.families.load_seconds;
        family.write_header(out);
        let name = &family.name;
        let loads = self.loads.lock().expect("lora metrics lock");
        for (transition, h) in &loads.histograms {
            let labels = family.labelled([transition.clone()]);
            let mut cumulative = 0.0;
            let bounds = family.buckets.iter().map(|b| format_value(*b));
            for (bound, n) in bounds.chain(["+Inf".to_string()]).zip(&h.buckets) {
                cumulative += n;
                let mut with_le = vec![("le", bound)];
                with_le.extend(labels.iter().cloned());
                write_sample(out, &format!("{name}_bucket"), &with_le, cumulative);
            }
            write_sample(out, &format!("{name}_count"), &labels, h.count);
            write_sample(out, &format!("{name}_sum"), &labels, h.sum);
        }
    }

    fn render_residency(&self, out: &mut String, views: &Views) {
        let model = &self.model;
        let loaded = self.families.loaded;
        loaded.write_header(out);
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
                        let labels = loaded.labelled([
                            adapter.clone(),
                            level.to_string(),
                            pinned.to_string(),
                            rank.to_string(),
                            model.clone(),
                            engine.to_string(),
                        ]);
                        write_sample(out, &loaded.name, &labels, 1.0);
                    }
                }
            }
        }
        for (level, family) in self.families.resident {
            family.write_header(out);
            let count = resident.get(level).map_or(0, BTreeSet::len);
            let labels = family.labelled([model.clone()]);
            write_sample(out, &family.name, &labels, count as f64);
        }
        let slots = self.families.slots;
        slots.write_header(out);
        let labels = slots.labelled([model.clone()]);
        write_sample(out, &slots.name, &labels, views.max_loras() as f64);
        let partial = self.families.partial;
        partial.write_header(out);
        for adapter in views.adapter_names() {
            let partly = views.views.values().any(|v| v.partial(&adapter));
            let labels = partial.labelled([adapter]);
            write_sample(out, &partial.name, &labels, f64::from(u8::from(partly)));
        }
        let info = self.families.requests_info;
        info.write_header(out);
        let labels = info.labelled([
            views.max_loras().to_string(),
            views.running_adapters().join(","),
            views.waiting_adapters().join(","),
        ]);
        write_sample(out, &info.name, &labels, views.requests_changed_at());
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn an_observation_lands_in_the_first_bucket_at_or_above_it() {
        let bounds = [0.001, 0.1, 0.5, 10.0];
        let mut h = Histogram::new(&bounds);
        h.observe(&bounds, 0.001); // on a bound: that bucket (le is "less or equal")
        h.observe(&bounds, 0.3);
        h.observe(&bounds, 11.0);
        assert_eq!(h.buckets, [1.0, 0.0, 1.0, 0.0, 1.0]); // the last: +Inf
        assert_eq!(h.count, 3.0);
        assert!((h.sum - 11.301).abs() < 1e-12);
    }
}
