//! `/metrics`: the engine-derived series, built only from what the engine core sends every API
//! server (its stats with each message, the catch-up snapshot, the notifications), so this
//! server reports them exactly as the Python servers do, line for line (same names, help, label
//! order and number formatting as prometheus_client's text exposition); the LoRA ones are
//! `lora_metrics`, and the series each API server counts itself and the fleet sums are
//! `request_metrics`. What the notifications say is read from the engine views
//! (`engine_views`), never counted here: notification totals, skipped types and drops are each
//! engine's view plus what its earlier incarnations counted, so they never go back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineStateSnapshot, SchedulerStats};
use rankcast_client::wire::{Dict, Value};
use rankcast_frontend::engine_views::{EngineViews, Views};
use rankcast_frontend::view::WEIGHTS_LOADED_KEY;

use crate::exposition::write_sample;
use crate::families::{self, Family};
use crate::lora_metrics::LoRAMetrics;
use crate::request_metrics::RequestMetrics;

/// Series in the order they were first set, as prometheus_client keeps a family's children;
/// each series' labels (name, value) in name order.
#[derive(Default)]
struct Samples {
    samples: Vec<(Vec<(&'static str, String)>, f64)>,
}

impl Samples {
    fn slot(&mut self, labels: Vec<(&'static str, String)>) -> &mut f64 {
        let mut sorted = labels;
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        match self.samples.iter().position(|(l, _)| *l == sorted) {
            Some(i) => &mut self.samples[i].1,
            None => {
                self.samples.push((sorted, 0.0));
                &mut self.samples.last_mut().expect("just pushed").1
            }
        }
    }
    fn set(&mut self, labels: Vec<(&'static str, String)>, value: f64) {
        *self.slot(labels) = value;
    }
    fn remove(&mut self, labels: &[(&'static str, String)]) {
        let mut sorted = labels.to_vec();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        self.samples.retain(|(l, _)| *l != sorted);
    }
}

/// One declared family and its series.
struct Series {
    family: &'static Family,
    samples: Samples,
    /// False: samples in the order first set (a prometheus_client metric's children). True:
    /// sorted by their label values in the declared order, as the Python servers' `ViewCounter`
    /// (an engine total seen by every server) writes them.
    sorted: bool,
}

impl Series {
    /// The series labelled `values` (in the declared label order) set to `value`.
    fn set(&mut self, values: impl IntoIterator<Item = String>, value: f64) {
        let labels = self.family.labelled(values);
        self.samples.set(labels, value);
    }

    fn remove(&mut self, values: impl IntoIterator<Item = String>) {
        self.samples.remove(&self.family.labelled(values));
    }

    /// Samples set anew, each scrape, from what the views count: each labelled differently
    /// (a map's entries), so each is added without looking for it first (a MoE model has
    /// thousands: layers x experts per rank).
    fn set_all(&mut self, samples: impl IntoIterator<Item = (Vec<String>, f64)>) {
        self.samples = Samples::default();
        for (values, value) in samples {
            let mut labels = self.family.labelled(values);
            labels.sort_by(|a, b| a.0.cmp(b.0));
            self.samples.samples.push((labels, value));
        }
    }

    fn samples(&self) -> Vec<&(Vec<(&'static str, String)>, f64)> {
        let mut samples: Vec<_> = self.samples.samples.iter().collect();
        if self.sorted {
            let key = |labels: &[(&'static str, String)]| -> Vec<String> {
                let value = |name: &str| labels.iter().find(|(k, _)| *k == name).map(|(_, v)| v);
                let names = self.family.labels.iter();
                names
                    .map(|name| value(name).cloned().unwrap_or_default())
                    .collect()
            };
            samples.sort_by_cached_key(|(labels, _)| key(labels));
        }
        samples
    }
}

/// The families, in the order the Python servers register them.
const RUNNING: usize = 0;
const WAITING: usize = 1;
const KV_USAGE: usize = 2;
const CACHE_CONFIG: usize = 3;
const ENGINE_UP: usize = 4;
const PREEMPTIONS: usize = 5;
const PREFIX_QUERIES: usize = 6;
const PREFIX_HITS: usize = 7;
const GATHERS: usize = 8;
const GATHER_SECONDS: usize = 9;
const NOTIFICATIONS: usize = 10;
const SKIPPED: usize = 11;
const DROPPED: usize = 12;
const WEIGHTS_SECONDS: usize = 13;
const WEIGHTS_BYTES: usize = 14;
const KV_COMMITTED: usize = 15;
const ROUTING_DECISIONS: usize = 16;
const ROUTING_EXPECTED: usize = 17;
const ROUTING_HIT: usize = 18;
const LORA_FOUND: usize = 19;
const LORA_UNDONE: usize = 20;
const SPEC_DRAFTS: usize = 21;
const SPEC_DRAFT_TOKENS: usize = 22;
const SPEC_ACCEPTED: usize = 23;
const SPEC_ACCEPTED_PER_POS: usize = 24;
const EXPERT_TOKENS: usize = 25;

/// Looked up in the declaration (`families`) when the server starts: a gauge, or a counter
/// of an engine total every server sees (the Python servers' `view_counter`).
fn families() -> Vec<Series> {
    let gauge = |name| Series {
        family: families::gauge(name),
        samples: Samples::default(),
        sorted: false,
    };
    let view = |name| Series {
        family: families::counter(name),
        samples: Samples::default(),
        sorted: true,
    };
    vec![
        gauge("vllm:num_requests_running"),
        gauge("vllm:num_requests_waiting"),
        gauge("vllm:kv_cache_usage_perc"),
        gauge("vllm:cache_config_info"),
        gauge("rankcast:engine_up"),
        gauge("vllm:num_preemptions"),
        view("vllm:prefix_cache_queries"),
        view("vllm:prefix_cache_hits"),
        gauge("rankcast:notification_gathers"),
        gauge("rankcast:notification_gather_seconds"),
        view("rankcast:engine_notifications"),
        view("rankcast:engine_notifications_skipped"),
        view("rankcast:worker_notifications_dropped"),
        gauge("rankcast:worker_weights_load_seconds"),
        gauge("rankcast:worker_weights_load_bytes"),
        gauge("rankcast:kv_cache_committed_bytes"),
        view("rankcast:routing_decisions"),
        view("rankcast:routing_expected_prefix_tokens"),
        view("rankcast:routing_hit_prefix_tokens"),
        view("rankcast:lora_requests_found"),
        view("rankcast:lora_evictions_undone"),
        // Speculative decoding, as vLLM counts it (the engine's totals, in its stats).
        view("vllm:spec_decode_num_drafts"),
        view("vllm:spec_decode_num_draft_tokens"),
        view("vllm:spec_decode_num_accepted_tokens"),
        view("vllm:spec_decode_num_accepted_tokens_per_pos"),
        // Tokens each rank's MoE layers routed to each expert (the ranks' expert-load events).
        view("rankcast:moe_expert_tokens"),
    ]
}

fn rank_label(rank: i64) -> String {
    if rank < 0 {
        "engine_core".into()
    } else {
        rank.to_string()
    }
}

fn number(value: Option<&Value>) -> Option<f64> {
    match value {
        Some(Value::Int(v)) => Some(*v as f64),
        Some(Value::Float(v)) => Some(*v),
        _ => None,
    }
}

/// The families, and the cache configuration labels last set (block size, cache dtype, blocks).
type State = (Vec<Series>, Option<(String, String, String)>);

/// What one engine's total-mirroring counters set from its stats showed (prefix-cache queries,
/// hits), and from which incarnation: a restarted engine counts from zero again, so its totals
/// are added to what the counters showed when it restarted, never set below it.
#[derive(Default)]
struct EngineTotals {
    incarnation: i64,
    base: HashMap<String, f64>,
    shown: HashMap<String, f64>,
}

impl EngineTotals {
    /// What the counter named `key` shows for the engine's total `value`.
    fn show(&mut self, key: &str, value: f64) -> f64 {
        let shown = self.base.get(key).copied().unwrap_or(0.0) + value;
        self.shown.insert(key.to_string(), shown);
        shown
    }
}

pub struct EngineMetrics {
    model: String,
    series: Mutex<State>,
    totals: Mutex<HashMap<i64, EngineTotals>>,
    lora: LoRAMetrics,
    /// What the engine-derived series render (the engine thread keeps them).
    views: Arc<EngineViews>,
    /// What this server counts itself, summed over the fleet (shown first, as in Python).
    pub requests: RequestMetrics,
}

impl EngineMetrics {
    pub fn new(model: &str, requests: RequestMetrics, views: Arc<EngineViews>) -> EngineMetrics {
        EngineMetrics {
            model: model.to_string(),
            series: Mutex::new((families(), None)),
            totals: Mutex::new(HashMap::new()),
            lora: LoRAMetrics::new(model),
            views,
            requests,
        }
    }

    /// The label values of a family labelled by model and engine.
    fn engine_labels(&self, engine: i64) -> [String; 2] {
        [self.model.clone(), engine.to_string()]
    }

    pub fn record_stats(&self, engine: i64, stats: &SchedulerStats) {
        let labels = self.engine_labels(engine);
        let mut guard = self.series.lock().expect("metrics lock");
        let (series, cache_labels) = &mut *guard;
        series[RUNNING].set(labels.clone(), stats.num_running_reqs as f64);
        series[WAITING].set(labels.clone(), stats.num_waiting_reqs as f64);
        series[KV_USAGE].set(labels.clone(), stats.kv_cache_usage);
        series[PREEMPTIONS].set(labels.clone(), stats.num_preemptions as f64);
        let e = || engine.to_string();
        {
            let mut all = self.totals.lock().expect("totals lock");
            let totals = all.entry(engine).or_default();
            let queries = totals.show("queries", stats.prefix_cache_queries as f64);
            let hits = totals.show("hits", stats.prefix_cache_hits as f64);
            series[PREFIX_QUERIES].set(labels.clone(), queries);
            series[PREFIX_HITS].set(labels.clone(), hits);
            for (reason, count) in &stats.routing_decisions.0 {
                let shown = totals.show(&format!("routed:{reason}"), *count as f64);
                series[ROUTING_DECISIONS].set([e(), reason.clone()], shown);
            }
            let expected = totals.show("expected", stats.routing_expected_prefix_tokens as f64);
            series[ROUTING_EXPECTED].set([e()], expected);
            let found = totals.show("found", stats.routing_hit_prefix_tokens as f64);
            series[ROUTING_HIT].set([e()], found);
            for (adapter, by_tier) in &stats.lora_requests_found.0 {
                for (tier, count) in &by_tier.0 {
                    let shown = totals.show(&format!("adapter:{adapter}:{tier}"), *count as f64);
                    series[LORA_FOUND].set([e(), adapter.clone(), tier.clone()], shown);
                }
            }
            for (adapter, count) in &stats.lora_evictions_undone.0 {
                let shown = totals.show(&format!("undone:{adapter}"), *count as f64);
                series[LORA_UNDONE].set([e(), adapter.clone()], shown);
            }
            if stats.spec_decode_num_drafts != 0 {
                let drafts = totals.show("drafts", stats.spec_decode_num_drafts as f64);
                series[SPEC_DRAFTS].set(labels.clone(), drafts);
                let drafted = totals.show("drafted", stats.spec_decode_num_draft_tokens as f64);
                series[SPEC_DRAFT_TOKENS].set(labels.clone(), drafted);
                let accepted =
                    totals.show("accepted", stats.spec_decode_num_accepted_tokens as f64);
                series[SPEC_ACCEPTED].set(labels.clone(), accepted);
                let per_pos = &stats.spec_decode_num_accepted_tokens_per_pos;
                for (position, count) in per_pos.iter().enumerate() {
                    let shown = totals.show(&format!("accepted_at:{position}"), *count as f64);
                    let [model, engine] = labels.clone();
                    series[SPEC_ACCEPTED_PER_POS].set([model, engine, position.to_string()], shown);
                }
            }
        }
        series[KV_COMMITTED].set(labels.clone(), stats.kv_cache_committed_bytes as f64);
        series[GATHERS].set([e()], stats.notification_gathers as f64);
        series[GATHER_SECONDS].set([e()], stats.notification_gather_seconds);
        let config = (
            stats.block_size.to_string(),
            stats.kv_cache_dtype.clone(),
            stats.num_blocks.to_string(),
        );
        if cache_labels.as_ref() != Some(&config) {
            let [model, engine] = labels;
            if let Some((block_size, dtype, blocks)) = cache_labels.take() {
                let old = [model.clone(), engine.clone(), block_size, dtype, blocks];
                series[CACHE_CONFIG].remove(old);
            }
            let new = [
                model,
                engine,
                config.0.clone(),
                config.1.clone(),
                config.2.clone(),
            ];
            series[CACHE_CONFIG].set(new, 1.0);
            *cache_labels = Some(config);
        }
    }

    pub fn record_engine_up(&self, engine: i64, up: bool) {
        let labels = self.engine_labels(engine);
        let mut guard = self.series.lock().expect("metrics lock");
        let series = &mut guard.0;
        series[ENGINE_UP].set([engine.to_string()], f64::from(u8::from(up)));
        if !up {
            for index in [RUNNING, WAITING, KV_USAGE] {
                series[index].set(labels.clone(), 0.0);
            }
        }
    }

    /// The engine's view started over from `snapshot` (apply it to the views first): show its
    /// weight loads, observe its load times. A new incarnation's stats totals (from zero again)
    /// count on from what was shown.
    pub fn apply_snapshot(&self, snapshot: &EngineStateSnapshot) {
        {
            let mut all = self.totals.lock().expect("totals lock");
            let totals = all.entry(snapshot.engine_index).or_default();
            if snapshot.incarnation != totals.incarnation {
                totals.incarnation = snapshot.incarnation;
                totals.base = totals.shown.clone();
            }
        }
        let engine = snapshot.engine_index;
        let weights: Vec<(i64, Dict<Value>)> = self.views.read(|views| {
            let view = views.views.get(&engine);
            view.map_or_else(Vec::new, |v| {
                let loaded = v.weights_loaded.iter();
                loaded.map(|(rank, p)| (*rank, p.clone())).collect()
            })
        });
        {
            let mut guard = self.series.lock().expect("metrics lock");
            for (rank, payload) in &weights {
                record_weights(&mut guard.0, &engine.to_string(), *rank, payload);
            }
        }
        self.follow_loads();
    }

    /// A batch the views have applied: its delivery lag, the weight loads it reported (as the
    /// views now have them), and its load times.
    pub fn consume(&self, notifications: &[Notification]) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        for published in notifications.iter().filter_map(Notification::timestamp) {
            self.requests.record_delivery_lag(now - published);
        }
        let weights: Vec<(i64, i64, Dict<Value>)> = self.views.read(|views| {
            let reported = notifications.iter().filter_map(|n| match n {
                Notification::Custom(c) if c.key == WEIGHTS_LOADED_KEY => {
                    let view = views.views.get(&c.engine_index);
                    let held = view.and_then(|v| v.weights_loaded.get(&c.rank));
                    Some((c.engine_index, c.rank, held.unwrap_or(&c.payload).clone()))
                }
                _ => None,
            });
            reported.collect()
        });
        if !weights.is_empty() {
            let mut guard = self.series.lock().expect("metrics lock");
            for (engine, rank, payload) in &weights {
                record_weights(&mut guard.0, &engine.to_string(), *rank, payload);
            }
        }
        self.follow_loads();
    }

    /// Observe the load times the views applied since the last look, each once.
    fn follow_loads(&self) {
        self.views.read(|views| self.lora.follow_loads(views));
    }

    /// The text exposition of every family, as prometheus_client renders it: the fleet's
    /// summed series, the engine series, then the LoRA ones, in the order the Python servers
    /// register them.
    pub fn exposition(&self) -> String {
        self.follow_loads();
        let mut out = String::new();
        self.requests.render(&mut out);
        let (totals, skipped, dropped, experts) = self.views.read(|views: &Views| {
            (
                views.notification_totals(),
                views.skipped_totals(),
                views.dropped_totals(),
                views.expert_token_totals(),
            )
        });
        {
            let mut guard = self.series.lock().expect("metrics lock");
            let series = &mut guard.0;
            series[NOTIFICATIONS].set_all(
                totals
                    .into_iter()
                    .map(|((kind, key), count)| (vec![kind, key], count as f64)),
            );
            series[SKIPPED].set_all(
                skipped
                    .into_iter()
                    .map(|(kind, count)| (vec![kind], count as f64)),
            );
            series[DROPPED].set_all(dropped.into_iter().map(|((engine, rank), count)| {
                (vec![engine.to_string(), rank_label(rank)], count as f64)
            }));
            series[EXPERT_TOKENS].set_all(experts.into_iter().flat_map(
                |((engine, rank, layer), tokens)| {
                    let labels = [engine.to_string(), rank_label(rank), layer.to_string()];
                    tokens.into_iter().enumerate().map(move |(expert, count)| {
                        let mut values = labels.to_vec();
                        values.push(expert.to_string());
                        (values, count as f64)
                    })
                },
            ));
            for s in series.iter() {
                s.family.write_header(&mut out);
                for (labels, value) in s.samples() {
                    write_sample(&mut out, &s.family.name, labels, *value);
                }
            }
        }
        self.views.read(|views| self.lora.render(&mut out, views));
        out
    }
}

fn record_weights(series: &mut [Series], engine: &str, rank: i64, payload: &Dict<Value>) {
    let labels = [engine.to_string(), rank_label(rank)];
    if let Some(seconds) = number(payload.get("seconds")) {
        series[WEIGHTS_SECONDS].set(labels.clone(), seconds);
    }
    if let Some(bytes) = number(payload.get("bytes")) {
        series[WEIGHTS_BYTES].set(labels, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::EngineMetrics;
    use crate::exposition::format_value;
    use crate::request_metrics::RequestMetrics;
    use rankcast_client::wire::from_bytes;
    use rankcast_client::wire::protocol::{EngineCoreMessage, EngineStateSnapshot, SchedulerStats};
    use rankcast_frontend::engine_views::EngineViews;

    fn fixture(name: &str) -> EngineCoreMessage {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../../tests/fixtures/wire/{name}.msgpack"));
        from_bytes(&std::fs::read(path).expect(name)).expect(name)
    }

    /// Engine 0's snapshot and stats from the golden fixtures, and the metrics of a server
    /// whose views hold that engine.
    fn engine_zero() -> (
        EngineStateSnapshot,
        SchedulerStats,
        std::sync::Arc<EngineViews>,
        EngineMetrics,
    ) {
        let EngineCoreMessage::Ready(ready) = fixture("output_ready") else {
            panic!()
        };
        let EngineCoreMessage::Outputs(step) = fixture("output_step") else {
            panic!()
        };
        let mut snapshot = ready.snapshot.expect("a snapshot");
        snapshot.engine_index = 0;
        let views = std::sync::Arc::new(EngineViews::new([0]));
        let metrics = EngineMetrics::new("m", RequestMetrics::new("m", 0, None), views.clone());
        (
            snapshot,
            step.scheduler_stats.expect("stats"),
            views,
            metrics,
        )
    }

    fn prefix_cache(metrics: &EngineMetrics) -> (f64, f64) {
        let text = metrics.exposition();
        let value = |name: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .unwrap_or_else(|| panic!("{name} in {text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        (
            value("vllm:prefix_cache_queries_total"),
            value("vllm:prefix_cache_hits_total"),
        )
    }

    #[test]
    fn engine_totals_count_on_across_an_engine_restart_never_back() {
        let (mut snapshot, mut stats, views, metrics) = engine_zero();
        let mut at = |incarnation: i64, queries: i64, hits: i64| {
            snapshot.incarnation = incarnation;
            views.apply_snapshot(&snapshot);
            metrics.apply_snapshot(&snapshot);
            stats.prefix_cache_queries = queries;
            stats.prefix_cache_hits = hits;
            metrics.record_stats(0, &stats);
            prefix_cache(&metrics)
        };
        assert_eq!(at(0, 100, 40), (100.0, 40.0));
        assert_eq!(at(0, 120, 50), (120.0, 50.0)); // a reconnect: nothing to add
        assert_eq!(at(1, 5, 1), (125.0, 51.0));
        assert_eq!(at(2, 0, 0), (125.0, 51.0));
    }

    /// The samples of `family` in `text`, each as (its labels, its value).
    fn samples(text: &str, family: &str) -> Vec<(String, f64)> {
        let prefix = format!("{family}{{");
        text.lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(|rest| {
                let (labels, value) = rest.rsplit_once("} ").expect("a sample");
                (labels.to_string(), value.parse().expect("a value"))
            })
            .collect()
    }

    #[test]
    fn spec_decode_counters_show_only_once_drafted_and_count_on_across_a_restart() {
        let (mut snapshot, mut stats, views, metrics) = engine_zero();
        let mut at = |incarnation: i64, drafts: i64, drafted: i64, per_pos: Vec<i64>| {
            snapshot.incarnation = incarnation;
            views.apply_snapshot(&snapshot);
            metrics.apply_snapshot(&snapshot);
            stats.spec_decode_num_drafts = drafts;
            stats.spec_decode_num_draft_tokens = drafted;
            stats.spec_decode_num_accepted_tokens = per_pos.iter().sum();
            stats.spec_decode_num_accepted_tokens_per_pos = per_pos;
            metrics.record_stats(0, &stats);
            let text = metrics.exposition();
            let one = |family: &str| -> Option<f64> {
                let found = samples(&text, family);
                assert!(found.len() <= 1, "{family}: {found:?}");
                found.first().map(|(labels, value)| {
                    assert_eq!(labels, "engine=\"0\",model_name=\"m\"");
                    *value
                })
            };
            let drafts = one("vllm:spec_decode_num_drafts_total");
            let drafted = one("vllm:spec_decode_num_draft_tokens_total");
            let accepted = one("vllm:spec_decode_num_accepted_tokens_total");
            let per_pos = samples(&text, "vllm:spec_decode_num_accepted_tokens_per_pos_total");
            (drafts, drafted, accepted, per_pos)
        };
        let pos = |p: &str, v: f64| (format!("engine=\"0\",model_name=\"m\",position=\"{p}\""), v);
        // No drafts yet (speculative decoding off): no series at all.
        assert_eq!(at(0, 0, 0, vec![]), (None, None, None, vec![]));
        assert_eq!(
            at(0, 4, 12, vec![3, 2, 1]),
            (
                Some(4.0),
                Some(12.0),
                Some(6.0),
                vec![pos("0", 3.0), pos("1", 2.0), pos("2", 1.0)]
            )
        );
        // A restarted engine counts from zero: added to what was shown, never back.
        assert_eq!(
            at(1, 1, 3, vec![1, 0, 0]),
            (
                Some(5.0),
                Some(15.0),
                Some(7.0),
                vec![pos("0", 4.0), pos("1", 2.0), pos("2", 1.0)]
            )
        );
        // Its first steps before any draft leave the counters as they were.
        let (drafts, _, _, per_pos) = at(2, 0, 0, vec![]);
        assert_eq!((drafts, per_pos.len()), (Some(5.0), 3));
    }

    #[test]
    fn values_are_written_as_prometheus_client_writes_them() {
        let cases = [
            (2.0, "2.0"),
            (0.125, "0.125"),
            (0.0, "0.0"),
            (1.5, "1.5"),
            (90177536.0, "9.0177536e+07"),
            (1234567.0, "1.234567e+06"),
            (123456.0, "123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-3.0, "-3.0"),
            (f64::INFINITY, "+Inf"),
            // Ties between two shortest forms go to the even digit, as in Python.
            (76365.0 / 131072.0, "0.5826187133789062"),
            (65537.0 / 131072.0, "0.5000076293945312"),
            (-65541.0 / 131072.0, "-0.5000381469726562"),
            (123.456, "123.456"),
            (1e-4 * 3.0, "0.00030000000000000003"),
            (1.0 / 3.0, "0.3333333333333333"),
            (2.5e-5, "2.5e-05"),
            (5e-324, "5e-324"),
            // Go's exponent form from 1e6, two digits at least (prometheus_client's).
            (1e15 + 0.125, "1.0000000000000001e+15"),
            (9999999999999998.0, "9.999999999999998e+15"),
            (1e16, "1e+16"),
            (f64::MAX, "1.7976931348623157e+308"),
        ];
        for (value, want) in cases {
            assert_eq!(format_value(value), want, "{value}");
        }
    }
}
