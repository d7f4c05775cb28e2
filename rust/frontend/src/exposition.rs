//! The Prometheus text exposition as prometheus_client writes it: family headers, sample lines
//! (labels in name order, escaped) and number formatting. Every `/metrics` module writes through
//! here, so none of them needs another (no module cycle: `tests/test_import_layers.py`).

use std::fmt::Write;

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
            return format!("{mantissa}e+0{}", dot - 1);
        }
    }
    s
}

/// Python's `repr(float)`: the shortest round-trip digits, fixed notation for exponents from
/// -4 to 15, else `1.5e-05` / `1e+16`.
fn python_repr(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let exponent = v.abs().log10().floor() as i32;
    if (-4..16).contains(&exponent) {
        let s = format!("{v}");
        return if s.contains('.') { s } else { format!("{s}.0") };
    }
    let s = format!("{v:e}"); // e.g. "1.5e-5"
    let (mantissa, exp) = s.split_once('e').expect("an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
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
