//! Every engine as this API server sees it: one `EngineView` per engine core (`view.rs`), and the
//! questions asked across them, as the Python servers' `EngineViews`
//! (`rankcast/engine_client/engine_views.py`).
//!
//! The engine thread is the only writer: each engine's catch-up snapshot, its notifications and
//! its stats. Everything else reads: request admission (adapter names and the pinned-slot
//! refusal), `/v1/models`, `/v1/lora_adapters`, `/v1/engine_views` and `/metrics`, which only
//! renders. Nothing else counts an event a second time.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineStateSnapshot, SchedulerStats};
use serde_json::{json, Value as Json};

use crate::view::{add_counts, ordered_tiers, EngineView};

/// What an engine's earlier incarnations counted, added under its current view's counts: a
/// restarted engine counts from zero again, and a counter never goes back.
#[derive(Debug, Default, Clone)]
pub struct EarlierTotals {
    pub totals: BTreeMap<(String, String), i64>,
    pub skipped: BTreeMap<String, i64>,
    pub dropped: BTreeMap<i64, i64>,
    pub lora_events: BTreeMap<(String, String, String), i64>,
    pub expert_tokens: BTreeMap<(i64, i64), Vec<i64>>,
}

fn add<K: Ord + Clone>(into: &mut BTreeMap<K, i64>, from: &BTreeMap<K, i64>) {
    for (key, count) in from {
        *into.entry(key.clone()).or_default() += count;
    }
}

impl EarlierTotals {
    fn add(&mut self, view: &EngineView) {
        add(&mut self.totals, &view.totals);
        add(&mut self.skipped, &view.skipped);
        add(&mut self.dropped, &view.dropped);
        add(&mut self.lora_events, &view.lora_events);
        for (key, tokens) in &view.expert_tokens {
            add_counts(self.expert_tokens.entry(*key).or_default(), tokens);
        }
    }
}

/// How far a reader has followed each engine's load times (a histogram observes each load once).
#[derive(Debug, Default)]
pub struct LoadsFollowed {
    /// engine -> (the snapshot its view had started from, its `loads_applied` then).
    seen: BTreeMap<i64, (u64, u64)>,
}

/// The views, by engine index (engine order), and what their earlier incarnations counted.
#[derive(Debug, Default)]
pub struct Views {
    pub views: BTreeMap<i64, EngineView>,
    pub earlier: BTreeMap<i64, EarlierTotals>,
    /// Per engine, how many snapshots its view has started from.
    snapshots: BTreeMap<i64, u64>,
}

/// The sum of `count` over every view and its earlier incarnations.
fn summed<K: Ord + Clone>(
    views: &Views,
    count: impl Fn(&EngineView) -> &BTreeMap<K, i64>,
    earlier: impl Fn(&EarlierTotals) -> &BTreeMap<K, i64>,
) -> BTreeMap<K, i64> {
    let mut out = BTreeMap::new();
    for view in views.views.values() {
        add(&mut out, count(view));
    }
    for totals in views.earlier.values() {
        add(&mut out, earlier(totals));
    }
    out
}

impl Views {
    fn view(&mut self, engine: i64) -> &mut EngineView {
        self.views
            .entry(engine)
            .or_insert_with(|| EngineView::new(engine, 0, None, None))
    }

    // ---- the writer: the engine thread ----

    pub fn apply_snapshot(&mut self, snapshot: &EngineStateSnapshot) {
        let engine = snapshot.engine_index;
        let view = self.view(engine);
        if snapshot.incarnation != view.incarnation {
            let before = view.clone();
            self.earlier.entry(engine).or_default().add(&before);
        }
        self.view(engine).apply_snapshot(snapshot);
        *self.snapshots.entry(engine).or_default() += 1;
    }

    /// One batch from `engine`: each event to the view of the engine that gathered it, a type
    /// this build does not know to the view of the engine that sent it.
    pub fn consume(&mut self, engine: i64, notifications: &[Notification]) {
        for n in notifications {
            let index = match n.engine_index() {
                Some(index) if self.views.contains_key(&index) => index,
                _ => engine,
            };
            self.view(index).apply(n);
        }
    }

    pub fn record_stats(&mut self, engine: i64, stats: &SchedulerStats) {
        self.view(engine).record_requests(
            &stats.running_lora_requests,
            &stats.waiting_lora_requests,
            stats.lora_requests_changed_at,
        );
    }

    // ---- readers ----

    /// Device slots per rank (0: no engine serves adapters).
    pub fn max_loras(&self) -> i64 {
        let slots = self
            .views
            .values()
            .filter_map(|v| v.lora.map(|l| l.max_loras));
        slots.max().unwrap_or(0)
    }

    pub fn serves_adapters(&self) -> bool {
        self.views.values().any(|v| v.lora.is_some())
    }

    /// Adapters some engine has registered, in name order (servable by name).
    pub fn adapter_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .views
            .values()
            .flat_map(|v| v.adapters.keys().cloned())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Why a request on `name` could not run on any engine until someone unpins: on each
    /// engine that has it, every device slot holds another pinned adapter. None: it can run.
    pub fn refusal(&self, name: &str) -> Option<String> {
        let mut blocked: Vec<String> = Vec::new();
        for view in self.views.values() {
            let Some(lora) = view.lora else { continue };
            if !view.adapters.contains_key(name) {
                continue;
            }
            let pinned: Vec<String> = view
                .pinned_in_device()
                .into_iter()
                .filter(|other| other != name)
                .collect();
            if (pinned.len() as i64) < lora.max_loras {
                return None;
            }
            blocked = pinned;
        }
        if blocked.is_empty() {
            return None;
        }
        Some(format!(
            "every device slot (--max-loras {}) holds a pinned adapter ({}); unpin one to serve '{name}'",
            self.max_loras(),
            blocked.join(", "),
        ))
    }

    pub fn running_adapters(&self) -> Vec<String> {
        self.adapters_of(|v| &v.running)
    }

    pub fn waiting_adapters(&self) -> Vec<String> {
        self.adapters_of(|v| &v.waiting)
    }

    fn adapters_of(&self, counts: impl Fn(&EngineView) -> &BTreeMap<String, i64>) -> Vec<String> {
        let mut names: Vec<String> = self
            .views
            .values()
            .flat_map(|v| counts(v).keys().cloned())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// When some engine's running or waiting adapter set last changed (engine clock).
    pub fn requests_changed_at(&self) -> f64 {
        let times = self.views.values().map(|v| v.requests_changed_at);
        times.fold(0.0, f64::max)
    }

    /// The incarnation of `engine` as its view has it (0 before its first snapshot).
    pub fn incarnation(&self, engine: i64) -> i64 {
        self.views.get(&engine).map_or(0, |v| v.incarnation)
    }

    /// Notification totals by (type, key), every engine and its earlier incarnations summed.
    pub fn notification_totals(&self) -> BTreeMap<(String, String), i64> {
        summed(self, |v| &v.totals, |e| &e.totals)
    }

    /// Notifications of types this build does not know, by type.
    pub fn skipped_totals(&self) -> BTreeMap<String, i64> {
        summed(self, |v| &v.skipped, |e| &e.skipped)
    }

    /// LoRA lifecycle events by (adapter, event, reason).
    pub fn lora_event_totals(&self) -> BTreeMap<(String, String, String), i64> {
        summed(self, |v| &v.lora_events, |e| &e.lora_events)
    }

    /// Dropped notifications by (engine, rank), earlier incarnations included.
    pub fn dropped_totals(&self) -> BTreeMap<(i64, i64), i64> {
        let mut out = BTreeMap::new();
        for (engine, view) in &self.views {
            for (rank, count) in &view.dropped {
                *out.entry((*engine, *rank)).or_default() += count;
            }
        }
        for (engine, earlier) in &self.earlier {
            for (rank, count) in &earlier.dropped {
                *out.entry((*engine, *rank)).or_default() += count;
            }
        }
        out
    }

    /// Tokens per expert by (engine, rank, layer), earlier incarnations included (what the
    /// expert counters show: they never go back).
    pub fn expert_token_totals(&self) -> BTreeMap<(i64, i64, i64), Vec<i64>> {
        let mut out: BTreeMap<(i64, i64, i64), Vec<i64>> = BTreeMap::new();
        let earlier = self.earlier.iter().map(|(e, t)| (e, &t.expert_tokens));
        let current = self.views.iter().map(|(e, v)| (e, &v.expert_tokens));
        for (engine, tokens) in earlier.chain(current) {
            for ((rank, layer), counts) in tokens {
                add_counts(out.entry((*engine, *rank, *layer)).or_default(), counts);
            }
        }
        out
    }

    /// The load times each view applied since `followed` last looked, oldest first, in engine
    /// order. A view that started over from a snapshot since is read from its start: its
    /// snapshot's loads are observed again (as the Python servers' histograms observe them).
    pub fn new_loads(&self, followed: &mut LoadsFollowed) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for (engine, view) in &self.views {
            let snapshots = self.snapshots.get(engine).copied().unwrap_or(0);
            let seen = match followed.seen.get(engine) {
                Some((at, seen)) if *at == snapshots => *seen,
                _ => 0,
            };
            let new = view.loads_applied.saturating_sub(seen) as usize;
            let new = new.min(view.loads.len());
            out.extend(view.loads.iter().skip(view.loads.len() - new).cloned());
            followed
                .seen
                .insert(*engine, (snapshots, view.loads_applied));
        }
        out
    }

    /// `/v1/lora_adapters`: per adapter its tiers, whether pinned, residency per engine and
    /// rank, request counts, and `partial` when the ranks of one engine disagree.
    pub fn describe_adapters(&self) -> Vec<Json> {
        let mut out = Vec::new();
        for name in self.adapter_names() {
            let (mut engines, mut tiers) = (Vec::new(), Vec::new());
            let (mut pinned, mut partial) = (false, false);
            for view in self.views.values() {
                let Some(adapter) = view.adapters.get(&name) else {
                    continue;
                };
                partial = partial || view.partial(&name);
                tiers.extend(adapter.ranks.values().flatten().cloned());
                pinned = pinned || !adapter.pinned.is_empty();
                let ranks: Vec<Json> = adapter
                    .ranks
                    .iter()
                    .map(|(rank, held)| {
                        json!({"rank": rank, "tiers": ordered_tiers(held),
                               "pinned": adapter.pinned.contains(rank)})
                    })
                    .collect();
                engines.push(json!({"engine": view.engine_index, "ranks": ranks}));
            }
            let requests = |counts: fn(&EngineView) -> &BTreeMap<String, i64>| -> i64 {
                let views = self.views.values();
                views
                    .map(|v| counts(v).get(&name).copied().unwrap_or(0))
                    .sum()
            };
            out.push(json!({
                "name": name,
                "tiers": ordered_tiers(&tiers),
                "pinned": pinned,
                "partial": partial,
                "running_requests": requests(|v| &v.running),
                "waiting_requests": requests(|v| &v.waiting),
                "engines": engines,
            }));
        }
        out
    }

    /// `/v1/engine_views`: every engine's view, in engine order.
    pub fn as_json(&self) -> Vec<Json> {
        self.views.values().map(EngineView::as_json).collect()
    }
}

/// The views behind a lock: the engine thread writes them, requests and scrapes read them.
#[derive(Debug, Default)]
pub struct EngineViews {
    state: Mutex<Views>,
}

impl EngineViews {
    /// A view for each engine this server follows, before its snapshot arrives.
    pub fn new(engines: impl IntoIterator<Item = i64>) -> EngineViews {
        let mut views = Views::default();
        for engine in engines {
            views.view(engine);
        }
        EngineViews {
            state: Mutex::new(views),
        }
    }

    pub fn apply_snapshot(&self, snapshot: &EngineStateSnapshot) {
        self.lock().apply_snapshot(snapshot);
    }

    pub fn consume(&self, engine: i64, notifications: &[Notification]) {
        self.lock().consume(engine, notifications);
    }

    pub fn record_stats(&self, engine: i64, stats: &SchedulerStats) {
        self.lock().record_stats(engine, stats);
    }

    /// Read every view at once (a scrape renders every series from one state).
    pub fn read<R>(&self, reader: impl FnOnce(&Views) -> R) -> R {
        reader(&self.lock())
    }

    fn lock(&self) -> MutexGuard<'_, Views> {
        self.state.lock().expect("engine views lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::decode_case;
    use rankcast_client::wire::Value;

    fn case(name: &str) -> (EngineStateSnapshot, Vec<Notification>) {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../../tests/fixtures/view/{name}.msgpack"));
        let bytes = std::fs::read(path).expect(name);
        decode_case(&mut bytes.as_slice()).expect(name)
    }

    #[test]
    fn counts_go_on_across_a_restart_and_loads_are_observed_once() {
        let (snapshot, events) = case("lora_tp2");
        let views = EngineViews::new([0]);
        views.apply_snapshot(&snapshot);
        views.consume(0, &events);
        let mut followed = LoadsFollowed::default();
        let loads = views.read(|v| v.new_loads(&mut followed));
        assert_eq!(loads.len(), 11, "every load and activation of the stream");
        assert!(views.read(|v| v.new_loads(&mut followed)).is_empty());
        let before = views.read(Views::notification_totals);
        let evicted = ("lora_adapter_evicted".to_string(), String::new());

        // The engine comes back as incarnation 1 with two evictions counted so far.
        let mut next = snapshot.clone();
        next.incarnation = 1;
        next.notifications.totals = vec![rankcast_client::wire::notifications::NotificationTotal {
            r#type: evicted.0.clone(),
            key: String::new(),
            count: 2,
        }];
        views.apply_snapshot(&next);
        let after = views.read(Views::notification_totals);
        assert_eq!(after[&evicted], before[&evicted] + 2);
        for (key, count) in &before {
            assert!(after[key] >= *count, "{key:?} went back");
        }
        assert!(views.read(|v| v.new_loads(&mut followed)).is_empty());
        let dropped = views.read(Views::dropped_totals);
        assert_eq!(dropped[&(0, 1)], 3);
        assert_eq!(views.read(|v| v.incarnation(0)), 1);
    }

    #[test]
    fn expert_totals_count_on_across_a_restart_never_back() {
        let (snapshot, events) = case("lora_tp2");
        let views = EngineViews::new([0]);
        views.apply_snapshot(&snapshot);
        views.consume(0, &events);
        let before = views.read(Views::expert_token_totals);
        assert_eq!(
            before[&(0, 0, 2)],
            vec![1, 4, 3, 2],
            "two windows of rank 0 added"
        );
        assert_eq!(before[&(0, 1, 2)], vec![1, 3, 3, 1]);
        // The engine comes back as incarnation 1, counting from none: nothing goes back.
        let mut next = snapshot.clone();
        next.incarnation = 1;
        views.apply_snapshot(&next);
        assert_eq!(views.read(Views::expert_token_totals), before);
        views.consume(0, &events);
        let after = views.read(Views::expert_token_totals);
        assert_eq!(after[&(0, 0, 2)], vec![2, 8, 6, 4]);
        assert_eq!(after.len(), before.len());
    }

    #[test]
    fn unknown_types_count_on_the_sending_engine() {
        let views = EngineViews::new([0]);
        let unknown = Notification::Unknown(Value::Map(vec![(
            Value::Str("type".into()),
            Value::Str("kv_future".into()),
        )]));
        views.consume(0, &[unknown]);
        assert_eq!(views.read(Views::skipped_totals)["kv_future"], 1);
    }

    #[test]
    fn a_request_waits_for_no_pinned_slot_it_cannot_have() {
        let (snapshot, events) = case("restarted");
        let views = EngineViews::new([0]);
        views.apply_snapshot(&snapshot);
        views.consume(0, &events);
        // One slot per rank, held by "a", pinned on both ranks now.
        let refusal = views.read(|v| v.refusal("b")).expect("a refusal");
        assert!(refusal.contains("holds a pinned adapter (a)"), "{refusal}");
        assert_eq!(views.read(|v| v.refusal("a")), None);
        assert_eq!(views.read(Views::adapter_names), ["a", "b"]);
        let described = views.read(Views::describe_adapters);
        assert_eq!(described[0]["tiers"], json!(["device", "cpu"]));
        assert_eq!(described[0]["pinned"], json!(true));
    }
}
