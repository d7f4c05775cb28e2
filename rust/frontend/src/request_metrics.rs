//! The series each API server counts itself (prompt and generated tokens, finished requests,
//! time to first token, inter-token and end-to-end latency, notification delivery lag, HTTP
//! requests by route), with
//! the names, labels, help and buckets declared for both kinds of server (`families`). Under
//! the launcher every value is also written to this process's multiprocess files, and a scrape
//! shows the sums over every API server's files (`multiprocess`), as the Python servers'
//! scrapes do; run alone, a scrape shows this server's own values.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::families::{self, Family};
use crate::multiprocess::{self, DbFile, Key};

/// The families this server counts itself, looked up in the declaration (`families`) when it
/// starts.
struct Declared {
    prompt_tokens: &'static Family,
    generation_tokens: &'static Family,
    request_success: &'static Family,
    ttft: &'static Family,
    itl: &'static Family,
    e2e: &'static Family,
    lag: &'static Family,
    http_requests: &'static Family,
}

impl Declared {
    fn look_up() -> Declared {
        Declared {
            prompt_tokens: families::counter("vllm:prompt_tokens"),
            generation_tokens: families::counter("vllm:generation_tokens"),
            request_success: families::counter("vllm:request_success"),
            ttft: families::histogram("vllm:time_to_first_token_seconds"),
            itl: families::histogram("vllm:inter_token_latency_seconds"),
            e2e: families::histogram("vllm:e2e_request_latency_seconds"),
            lag: families::histogram("rankcast:notification_delivery_lag_seconds"),
            http_requests: families::counter("http_requests"),
        }
    }

    /// The summed families' names in the multiprocess files, as the Python servers' `SUMMED`.
    fn summed(&self) -> [&'static str; 8] {
        [
            self.http_requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.ttft,
            self.itl,
            self.e2e,
            self.lag,
        ]
        .map(Family::base)
    }
}

/// This server's values of one metric type: in memory (what a scrape without the shared
/// directory shows) and, under the launcher, in its file. A series is looked up once, into a
/// slot; a token's update is then a store to memory.
struct Store {
    kind: &'static str,
    entries: Vec<(Key, f64)>,
    positions: Vec<usize>,
    file: Option<DbFile>,
}

impl Store {
    fn open(kind: &'static str, directory: Option<&std::path::Path>) -> Store {
        let file = directory.and_then(|d| match DbFile::create(d, kind) {
            Ok(file) => Some(file),
            Err(e) => {
                eprintln!("rankcast-frontend: the fleet's metrics directory: {e}");
                None
            }
        });
        Store {
            kind,
            entries: Vec::new(),
            positions: Vec::new(),
            file,
        }
    }

    /// A new series at 0 (prometheus_client creates each at 0 before its first change).
    fn create(&mut self, key: Key) -> usize {
        let position = match self.file.as_mut().map(|file| file.append(&key)) {
            Some(Ok(position)) => position,
            Some(Err(e)) => {
                eprintln!("rankcast-frontend: writing the fleet's metrics: {e}");
                self.file = None;
                0
            }
            None => 0,
        };
        self.entries.push((key, 0.0));
        self.positions.push(position);
        self.entries.len() - 1
    }

    fn add(&mut self, slot: usize, by: f64) {
        let value = self.entries[slot].1 + by;
        self.entries[slot].1 = value;
        if let Some(file) = &mut self.file {
            file.write_value(self.positions[slot], value);
        }
    }
}

/// One histogram series: the slot of its sum, then one per bucket bound (+Inf last).
struct Child {
    sum: usize,
    buckets: Vec<usize>,
}

/// This server's series, created on first use (as prometheus_client creates a child).
struct Series {
    counters: Store,
    histograms: Store,
    /// (counter name, label values) -> slot.
    counter_slots: HashMap<(&'static str, Vec<String>), usize>,
    /// histogram name -> its one series (this server's labels are fixed).
    children: HashMap<&'static str, Child>,
}

pub struct RequestMetrics {
    families: Declared,
    model: String,
    api_server: String,
    directory: Option<PathBuf>,
    series: Mutex<Series>,
}

impl RequestMetrics {
    /// `directory`: the launcher's PROMETHEUS_MULTIPROC_DIR, when there is one.
    pub fn new(model: &str, api_server: i64, directory: Option<PathBuf>) -> RequestMetrics {
        let series = Series {
            counters: Store::open("counter", directory.as_deref()),
            histograms: Store::open("histogram", directory.as_deref()),
            counter_slots: HashMap::new(),
            children: HashMap::new(),
        };
        RequestMetrics {
            families: Declared::look_up(),
            model: model.to_string(),
            api_server: api_server.to_string(),
            directory,
            series: Mutex::new(series),
        }
    }

    /// `counter`'s series labelled `values` (in the declared label order) up `by`.
    fn inc<const N: usize>(&self, counter: &'static Family, values: [String; N], by: f64) {
        let mut series = self.series.lock().expect("metrics lock");
        let series = &mut *series;
        let slot = *series
            .counter_slots
            .entry((counter.base(), values.to_vec()))
            .or_insert_with(|| {
                let labels = counter.labelled(values);
                let key = Key::new(counter.base(), &counter.name, &labels, &counter.help);
                series.counters.create(key)
            });
        series.counters.add(slot, by);
    }

    /// `times` observations of `seconds` in `histogram`'s one series (labelled `values`, in
    /// the declared label order).
    fn observe<const N: usize>(
        &self,
        histogram: &'static Family,
        values: [String; N],
        seconds: f64,
        times: u32,
    ) {
        let mut series = self.series.lock().expect("metrics lock");
        let series = &mut *series;
        let store = &mut series.histograms;
        let name = histogram.base();
        let bounds = &histogram.buckets;
        let child = series.children.entry(name).or_insert_with(|| {
            let labels = histogram.labelled(values);
            let key = |sample: &str, labels: &[(&str, String)]| {
                let sample = format!("{name}_{sample}");
                Key::new(name, &sample, labels, &histogram.help)
            };
            // The sum first, then the buckets in bound order, as prometheus_client writes them.
            let sum = store.create(key("sum", &labels));
            let buckets = bounds
                .iter()
                .copied()
                .chain([f64::INFINITY])
                .map(|bound| {
                    let mut with_le = labels.clone();
                    with_le.push(("le", crate::exposition::format_value(bound)));
                    store.create(key("bucket", &with_le))
                })
                .collect();
            Child { sum, buckets }
        });
        let bucket = bounds
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(bounds.len());
        for _ in 0..times {
            store.add(child.sum, seconds);
            store.add(child.buckets[bucket], 1.0);
        }
    }

    fn model(&self) -> [String; 1] {
        [self.model.clone()]
    }

    pub fn record_first_token(&self, seconds: f64) {
        self.observe(self.families.ttft, self.model(), seconds, 1);
    }

    pub fn record_inter_token(&self, seconds: f64, tokens: u32) {
        self.observe(self.families.itl, self.model(), seconds, tokens);
    }

    pub fn record_finished(
        &self,
        engine: i64,
        e2e_seconds: f64,
        prompt_tokens: usize,
        generation_tokens: usize,
        finish_reason: &str,
    ) {
        let f = &self.families;
        self.observe(f.e2e, self.model(), e2e_seconds, 1);
        self.inc(f.prompt_tokens, self.model(), prompt_tokens as f64);
        self.inc(f.generation_tokens, self.model(), generation_tokens as f64);
        let values = [
            self.model.clone(),
            engine.to_string(),
            finish_reason.to_string(),
        ];
        self.inc(f.request_success, values, 1.0);
    }

    /// One notification received `seconds` after it was published.
    pub fn record_delivery_lag(&self, seconds: f64) {
        let values = [self.api_server.clone()];
        self.observe(self.families.lag, values, seconds.max(0.0), 1);
    }

    /// One HTTP request answered, labelled as `route_metrics` says.
    pub fn record_http_request(&self, method: &str, status: &str, handler: &str) {
        let values = [method.to_string(), status.to_string(), handler.to_string()];
        self.inc(self.families.http_requests, values, 1.0);
    }

    /// The summed families: every API server's files, or without them this server's values.
    pub fn render(&self, out: &mut String) {
        let files = match &self.directory {
            Some(directory) => multiprocess::read_directory(directory),
            None => {
                let series = self.series.lock().expect("metrics lock");
                [&series.counters, &series.histograms]
                    .iter()
                    .map(|s| (s.kind.to_string(), s.entries.clone()))
                    .collect()
            }
        };
        multiprocess::render(out, &files, &self.families.summed());
    }
}
