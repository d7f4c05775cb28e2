//! The series each API server counts itself (prompt and generated tokens, finished requests,
//! time to first token, inter-token and end-to-end latency, notification delivery lag), under
//! the Python servers' names, labels, help and buckets. Under the launcher every value is also
//! written to this process's multiprocess files, and a scrape shows the sums over every API
//! server's files (`multiprocess`), as the Python servers' scrapes do; run alone, a scrape shows
//! this server's own values.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::multiprocess::{self, DbFile, Key};

const LATENCY_BUCKETS: [f64; 13] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0, 120.0,
];
const ITL_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
const LAG_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

struct Counter {
    name: &'static str,
    help: &'static str,
}

const PROMPT_TOKENS: Counter = Counter {
    name: "vllm:prompt_tokens",
    help: "Prompt tokens of finished requests (every API server's).",
};
const GENERATION_TOKENS: Counter = Counter {
    name: "vllm:generation_tokens",
    help: "Tokens generated for finished requests (every API server's).",
};
const REQUEST_SUCCESS: Counter = Counter {
    name: "vllm:request_success",
    help: "Finished requests (every API server's), by the engine that ran them and reason.",
};

struct Histogram {
    name: &'static str,
    help: &'static str,
    buckets: &'static [f64],
}

const TTFT: Histogram = Histogram {
    name: "vllm:time_to_first_token_seconds",
    help: "Time from arrival to the first generated token.",
    buckets: &LATENCY_BUCKETS,
};
const ITL: Histogram = Histogram {
    name: "vllm:inter_token_latency_seconds",
    help: "Time between consecutive generated tokens.",
    buckets: &ITL_BUCKETS,
};
const E2E: Histogram = Histogram {
    name: "vllm:e2e_request_latency_seconds",
    help: "Time from arrival to the last token.",
    buckets: &LATENCY_BUCKETS,
};
const LAG: Histogram = Histogram {
    name: "rankcast:notification_delivery_lag_seconds",
    help: "Time from publish in a worker rank to receipt by the API server named.",
    buckets: &LAG_BUCKETS,
};

/// The summed families, as the Python servers' `SUMMED`.
const SUMMED: [&str; 7] = [
    PROMPT_TOKENS.name,
    GENERATION_TOKENS.name,
    REQUEST_SUCCESS.name,
    TTFT.name,
    ITL.name,
    E2E.name,
    LAG.name,
];

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
            model: model.to_string(),
            api_server: api_server.to_string(),
            directory,
            series: Mutex::new(series),
        }
    }

    fn inc(&self, counter: &Counter, labels: &[(&str, String)], by: f64) {
        let mut series = self.series.lock().expect("metrics lock");
        let series = &mut *series;
        let values = labels.iter().map(|(_, v)| v.clone()).collect();
        let slot = *series
            .counter_slots
            .entry((counter.name, values))
            .or_insert_with(|| {
                let sample = format!("{}_total", counter.name);
                let key = Key::new(counter.name, &sample, labels, counter.help);
                series.counters.create(key)
            });
        series.counters.add(slot, by);
    }

    /// `times` observations of `seconds` in `histogram`'s one series (labelled `labels`).
    fn observe(&self, histogram: &Histogram, labels: &[(&str, String)], seconds: f64, times: u32) {
        let mut series = self.series.lock().expect("metrics lock");
        let series = &mut *series;
        let store = &mut series.histograms;
        let child = series.children.entry(histogram.name).or_insert_with(|| {
            let key = |sample: &str, labels: &[(&str, String)]| {
                let sample = format!("{}_{sample}", histogram.name);
                Key::new(histogram.name, &sample, labels, histogram.help)
            };
            // The sum first, then the buckets in bound order, as prometheus_client writes them.
            let sum = store.create(key("sum", labels));
            let bounds = histogram.buckets.iter().copied().chain([f64::INFINITY]);
            let buckets = bounds
                .map(|bound| {
                    let mut with_le = labels.to_vec();
                    with_le.push(("le", crate::exposition::format_value(bound)));
                    store.create(key("bucket", &with_le))
                })
                .collect();
            Child { sum, buckets }
        });
        let bucket = histogram
            .buckets
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(histogram.buckets.len());
        for _ in 0..times {
            store.add(child.sum, seconds);
            store.add(child.buckets[bucket], 1.0);
        }
    }

    fn model(&self) -> [(&'static str, String); 1] {
        [("model_name", self.model.clone())]
    }

    pub fn record_first_token(&self, seconds: f64) {
        self.observe(&TTFT, &self.model(), seconds, 1);
    }

    pub fn record_inter_token(&self, seconds: f64, tokens: u32) {
        self.observe(&ITL, &self.model(), seconds, tokens);
    }

    pub fn record_finished(
        &self,
        engine: i64,
        e2e_seconds: f64,
        prompt_tokens: usize,
        generation_tokens: usize,
        finish_reason: &str,
    ) {
        self.observe(&E2E, &self.model(), e2e_seconds, 1);
        self.inc(&PROMPT_TOKENS, &self.model(), prompt_tokens as f64);
        self.inc(&GENERATION_TOKENS, &self.model(), generation_tokens as f64);
        let labels = [
            ("model_name", self.model.clone()),
            ("engine", engine.to_string()),
            ("finished_reason", finish_reason.to_string()),
        ];
        self.inc(&REQUEST_SUCCESS, &labels, 1.0);
    }

    /// One notification received `seconds` after it was published.
    pub fn record_delivery_lag(&self, seconds: f64) {
        let labels = [("api_server", self.api_server.clone())];
        self.observe(&LAG, &labels, seconds.max(0.0), 1);
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
        multiprocess::render(out, &files, &SUMMED);
    }
}
