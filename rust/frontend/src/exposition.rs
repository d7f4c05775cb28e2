//! The Prometheus text exposition as prometheus_client writes it: family headers, sample lines
//! (labels in name order, escaped) and number formatting. Every `/metrics` module writes through
//! here, so none of them needs another (no module cycle: `tests/test_import_layers.py`).

use std::fmt::Write;

use rankcast_frontend::pyjson::float_repr as python_repr;

/// A float as prometheus_client writes it: Python's repr, with Go's exponent form for large
/// positive values.
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let s = python_repr(v);
    if let Some(dot) = s.find('.') {
        if v > 0.0 && dot > 6 {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{}", &s[..1], digits);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            return format!("{mantissa}e+{:02}", dot - 1);
        }
    }
    s
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('"', "\\\"")
}

/// The `# HELP` and `# TYPE` lines of a family.
pub fn write_header(out: &mut String, name: &str, help: &str, kind: &str) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One sample line, its labels in name order as prometheus_client writes them.
pub fn write_sample(out: &mut String, name: &str, labels: &[(&str, String)], value: f64) {
    let mut sorted: Vec<&(&str, String)> = labels.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let rendered: Vec<String> = sorted
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
        .collect();
    let _ = writeln!(
        out,
        "{name}{{{}}} {}",
        rendered.join(","),
        format_value(value)
    );
}

#[cfg(test)]
mod tests {
    use super::format_value;
    use std::path::PathBuf;

    /// Every value of `tests/fixtures/metrics/values.txt` spelt as the Python servers of the
    /// same fleet spell it: in an exposition as prometheus_client does, ties between two
    /// shortest forms included, and in `/v1/events` JSON (serde_json here) as msgspec does.
    #[test]
    fn values_match_prometheus_clients_and_msgspecs_spelling() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/metrics/values.txt");
        let text = std::fs::read_to_string(&path).expect("the values fixture");
        let mut checked = 0;
        let mut wrong = Vec::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let [bits, exposition, json] = fields[..] else {
                panic!("bits, exposition and JSON: {line}");
            };
            let value = f64::from_bits(u64::from_str_radix(bits, 16).expect("hex bits"));
            let got = (
                format_value(value),
                serde_json::to_string(&value).expect("a finite double"),
            );
            if got.0 != exposition || got.1 != json {
                wrong.push(format!("{bits}: {got:?} (want {exposition} {json})"));
            }
            checked += 1;
        }
        assert!(checked > 4000, "only {checked} values");
        assert!(
            wrong.is_empty(),
            "{} of {checked} differ: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
    }
}
