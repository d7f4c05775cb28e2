//! This server's `/metrics` families against `rankcast/api_server/metrics/families.json`, the
//! declaration both kinds of server build theirs from (`families` compiles it in here) and the
//! Python servers are held to as well (`tests/test_metrics_spec.py`): fed the same golden wire
//! messages and a few requests, every family this server exposes is declared there with the
//! same type, labels (compared as sets: the declaration lists them in the order their values are
//! given, expositions in name order) and help, and every declared family is exposed.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::EngineCoreMessage;
use rankcast_client::wire::{from_bytes, Raw};
use rankcast_frontend::engine_views::EngineViews;

use crate::metrics::EngineMetrics;
use crate::request_metrics::RequestMetrics;

const MODEL: &str = "m";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn message(name: &str) -> EngineCoreMessage {
    let bytes = fs::read(fixtures().join("wire").join(format!("{name}.msgpack"))).expect(name);
    from_bytes(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// (type, sorted label names, help, samples) by family name, `_created` companions left out.
type Families = BTreeMap<String, (String, Vec<String>, String, usize)>;

fn parse(text: &str) -> Families {
    let mut families = Families::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let help = help.replace("\\n", "\n").replace("\\\\", "\\");
            families.entry(name.to_string()).or_default().2 = help;
            current = name.to_string();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("a TYPE line");
            families.entry(name.to_string()).or_default().0 = kind.to_string();
            current = name.to_string();
        } else if !line.is_empty() && !line.starts_with('#') {
            let sample = line.split(['{', ' ']).next().unwrap_or("");
            if sample.ends_with("_created") {
                continue;
            }
            let mut names = label_names(line);
            names.retain(|n| n != "le" && n != "quantile");
            names.sort();
            let family = families.get_mut(&current).expect("a sample after its TYPE");
            assert!(
                family.3 == 0 || family.1 == names,
                "{current}: samples labelled {names:?} and {:?}",
                family.1
            );
            family.1 = names;
            family.3 += 1;
        }
    }
    families.retain(|name, _| !name.ends_with("_created"));
    families
}

/// The label names of one sample line, skipping over quoted values (which may hold `,` `=` `"`).
fn label_names(line: &str) -> Vec<String> {
    let Some(start) = line.find('{') else {
        return Vec::new();
    };
    let mut names = Vec::new();
    let mut chars = line[start + 1..].chars();
    let mut name = String::new();
    while let Some(c) = chars.next() {
        match c {
            '=' => {
                names.push(std::mem::take(&mut name));
                assert_eq!(chars.next(), Some('"'), "{line}");
                let mut escaped = false;
                for v in chars.by_ref() {
                    match (escaped, v) {
                        (false, '\\') => escaped = true,
                        (false, '"') => break,
                        _ => escaped = false,
                    }
                }
            }
            ',' => {}
            '}' => break,
            c => name.push(c),
        }
    }
    names
}

fn exposition() -> String {
    let views = std::sync::Arc::new(EngineViews::new([0]));
    let metrics = EngineMetrics::new(MODEL, RequestMetrics::new(MODEL, 0, None), views.clone());
    let EngineCoreMessage::Ready(ready) = message("output_ready") else {
        panic!("output_ready is not a ready message")
    };
    let snapshot = ready
        .snapshot
        .expect("the ready fixture carries a snapshot");
    views.apply_snapshot(&snapshot);
    metrics.apply_snapshot(&snapshot);
    metrics.record_engine_up(0, true);
    for name in ["output_step", "output_notifications"] {
        let EngineCoreMessage::Outputs(outputs) = message(name) else {
            panic!("{name} is not an outputs message")
        };
        if let Some(stats) = &outputs.scheduler_stats {
            views.record_stats(outputs.engine_index, stats);
            metrics.record_stats(outputs.engine_index, stats);
        }
        let decoded: Vec<Notification> = outputs
            .engine_notifications
            .unwrap_or_default()
            .iter()
            .filter_map(|raw| raw.decode_as().ok())
            .collect();
        views.consume(outputs.engine_index, &decoded);
        metrics.consume(&decoded);
    }
    // A type from a newer engine: counted and skipped.
    let future = Raw(vec![
        0x81, 0xa4, b't', b'y', b'p', b'e', 0xa3, b'n', b'e', b'w',
    ]);
    let unknown: Notification = future.decode_as().expect("an unknown type still decodes");
    views.consume(0, &[unknown]);
    metrics.consume(&[]);
    metrics.requests.record_first_token(0.05);
    metrics.requests.record_inter_token(0.02, 3);
    metrics.requests.record_finished(0, 1.5, 12, 34, "stop");
    metrics
        .requests
        .record_http_request("POST", "2xx", "/v1/completions");
    metrics.exposition()
}

#[test]
fn the_rust_servers_families_are_the_declared_ones() {
    let spec = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../rankcast/api_server/metrics/families.json");
    let text = fs::read_to_string(spec).expect("the declared families");
    let declared: Vec<serde_json::Value> = serde_json::from_str(&text).expect("JSON");
    let exposed = parse(&exposition());
    let mut problems = Vec::new();
    for family in &declared {
        let name = family["name"].as_str().expect("a name");
        let Some((kind, labels, help, samples)) = exposed.get(name) else {
            problems.push(format!("declared but not exposed: {name}"));
            continue;
        };
        let mut want_labels: Vec<String> = family["labels"]
            .as_array()
            .expect("labels")
            .iter()
            .map(|l| l.as_str().expect("a label").to_string())
            .collect();
        want_labels.sort();
        if kind != family["type"].as_str().unwrap_or("") {
            problems.push(format!("{name}: type {kind}, declared {}", family["type"]));
        }
        if help != family["help"].as_str().unwrap_or("") {
            problems.push(format!(
                "{name}: help {help:?}, declared {}",
                family["help"]
            ));
        }
        if *samples == 0 {
            problems.push(format!(
                "{name}: no sample, so its labels cannot be checked"
            ));
        } else if *labels != want_labels {
            problems.push(format!(
                "{name}: labels {labels:?}, declared {want_labels:?}"
            ));
        }
    }
    for name in exposed.keys() {
        if !declared.iter().any(|f| f["name"].as_str() == Some(name)) {
            problems.push(format!("exposed but not declared: {name}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_parser_reads_families_and_labels_and_skips_created() {
    let text = "# HELP a_total Things.\n# TYPE a_total counter\n\
                a_total{x=\"1\",y=\"q\\\"uo,=te\"} 2.0\na_created{x=\"1\",y=\"2\"} 1.0\n\
                # HELP h Seconds.\n# TYPE h histogram\nh_bucket{le=\"0.1\",m=\"a\"} 1.0\n";
    let families = parse(text);
    assert_eq!(
        families["a_total"].1,
        vec!["x".to_string(), "y".to_string()]
    );
    assert_eq!(families["h"].1, vec!["m".to_string()]);
    assert_eq!(families.len(), 2);
}
