//! Every `/metrics` family as declared once, in `rankcast/api_server/metrics/families.json`: the
//! name as exposed (a counter's with `_total`), type, label names in the order their values are
//! given, help text and a histogram's buckets. The Python servers build their families from the
//! same file (`rankcast/api_server/metrics/families.py`); this server compiles it in, so no help
//! text, label list or bucket bound of a declared family is written in Rust. A new family is one
//! entry there and the code that sets its values.
//!
//! Families are looked up as the Python code looks them up (`declared(name)`: a counter by its
//! name without `_total`), when a metrics module is built, so a family the file does not declare
//! (or declares with another type) stops the server at start with its name, never a default.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::exposition::write_header;

const PATH: &str = "rankcast/api_server/metrics/families.json";
const DECLARATION: &str = include_str!("../../../rankcast/api_server/metrics/families.json");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn parse(text: &str) -> Option<Kind> {
        match text {
            "counter" => Some(Kind::Counter),
            "gauge" => Some(Kind::Gauge),
            "histogram" => Some(Kind::Histogram),
            _ => None,
        }
    }

    /// As a `# TYPE` line and prometheus_client's multiprocess files spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One declared family.
#[derive(Debug)]
pub struct Family {
    /// As exposed: a counter's with `_total`.
    pub name: String,
    pub kind: Kind,
    /// In the order the code gives their values.
    pub labels: Vec<String>,
    pub help: String,
    /// A histogram's bucket bounds (`+Inf` not among them); empty for other types.
    pub buckets: Vec<f64>,
}

impl Family {
    /// The name the code looks the family up by and prometheus_client's multiprocess files key
    /// it by: a counter's without `_total`.
    pub fn base(&self) -> &str {
        match self.kind {
            Kind::Counter => self.name.strip_suffix("_total").unwrap_or(&self.name),
            _ => &self.name,
        }
    }

    /// The label names paired with `values`, given in the declared order.
    pub fn labelled<I>(&'static self, values: I) -> Vec<(&'static str, String)>
    where
        I: IntoIterator<Item = String>,
    {
        let values: Vec<String> = values.into_iter().collect();
        assert_eq!(
            values.len(),
            self.labels.len(),
            "{}: {} label values {values:?} for the labels {:?} declared in {PATH}",
            self.name,
            values.len(),
            self.labels
        );
        self.labels.iter().map(String::as_str).zip(values).collect()
    }

    /// The family's `# HELP` and `# TYPE` lines.
    pub fn write_header(&self, out: &mut String) {
        write_header(out, &self.name, &self.help, self.kind.as_str());
    }
}

fn parse(text: &str) -> Result<Vec<Family>, String> {
    let rows: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    rows.iter().map(family).collect()
}

fn family(row: &serde_json::Value) -> Result<Family, String> {
    let field = |key: &str| row.get(key).ok_or_else(|| format!("{row}: no {key:?}"));
    let string = |key: &str| {
        let value = field(key)?;
        let text = value
            .as_str()
            .ok_or_else(|| format!("{row}: {key:?} is not a string"));
        text.map(str::to_string)
    };
    let name = string("name")?;
    let kind = string("type")?;
    let kind = Kind::parse(&kind).ok_or_else(|| format!("{name}: no such type {kind:?}"))?;
    let labels = field("labels")?
        .as_array()
        .ok_or_else(|| format!("{name}: labels are not a list"))?
        .iter()
        .map(|l| l.as_str().map(str::to_string))
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| format!("{name}: a label is not a string"))?;
    let buckets = match row.get("buckets") {
        None => Vec::new(),
        Some(b) => b
            .as_array()
            .ok_or_else(|| format!("{name}: buckets are not a list"))?
            .iter()
            .map(serde_json::Value::as_f64)
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| format!("{name}: a bucket is not a number"))?,
    };
    if (kind == Kind::Histogram) == buckets.is_empty() {
        return Err(format!("{name}: buckets for a histogram, and only for one"));
    }
    if kind == Kind::Counter && !name.ends_with("_total") {
        return Err(format!("{name}: a counter's name ends in _total"));
    }
    Ok(Family {
        name,
        kind,
        labels,
        help: string("help")?,
        buckets,
    })
}

/// The declared families by the name the code uses (`Family::base`), parsed once.
fn families() -> &'static HashMap<String, Family> {
    static FAMILIES: OnceLock<HashMap<String, Family>> = OnceLock::new();
    FAMILIES.get_or_init(|| {
        let families = parse(DECLARATION).unwrap_or_else(|e| panic!("{PATH}: {e}"));
        let mut by_base = HashMap::new();
        for family in families {
            let base = family.base().to_string();
            if let Some(twice) = by_base.insert(base, family) {
                panic!("{PATH}: {} declared twice", twice.name);
            }
        }
        by_base
    })
}

/// The declaration of a family by the name the code uses (a counter's without `_total`); a
/// family the file does not declare is a panic naming it.
pub fn declared(name: &str) -> &'static Family {
    families()
        .get(name)
        .unwrap_or_else(|| panic!("{name} is not declared in {PATH}"))
}

fn declared_as(name: &str, kind: Kind) -> &'static Family {
    let family = declared(name);
    assert_eq!(
        family.kind,
        kind,
        "{name} is declared a {} in {PATH}; this server keeps it as a {}",
        family.kind.as_str(),
        kind.as_str()
    );
    family
}

pub fn counter(name: &str) -> &'static Family {
    declared_as(name, Kind::Counter)
}

pub fn gauge(name: &str) -> &'static Family {
    declared_as(name, Kind::Gauge)
}

pub fn histogram(name: &str) -> &'static Family {
    declared_as(name, Kind::Histogram)
}

#[cfg(test)]
mod tests {
    use super::{counter, declared, families, gauge, histogram, parse, Kind};

    #[test]
    fn the_declaration_parses_and_every_family_is_found_by_its_base_name() {
        let all = families();
        assert!(all.len() > 30, "{} families", all.len());
        for (base, family) in all {
            assert_eq!(declared(base).name, family.name);
            let bounds = &family.buckets;
            assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{}", family.name);
        }
        let ttft = histogram("vllm:time_to_first_token_seconds");
        assert_eq!(ttft.labels, ["model_name"]);
        assert_eq!(ttft.buckets.first(), Some(&0.01));
        let success = counter("vllm:request_success");
        assert_eq!(success.name, "vllm:request_success_total");
        assert_eq!(success.kind, Kind::Counter);
    }

    #[test]
    #[should_panic(expected = "vllm:no_such_family is not declared in")]
    fn an_undeclared_family_is_a_panic_naming_it() {
        declared("vllm:no_such_family");
    }

    #[test]
    #[should_panic(expected = "is declared a gauge")]
    fn a_family_kept_as_another_type_is_a_panic() {
        counter("vllm:num_requests_running");
    }

    #[test]
    #[should_panic(expected = "1 label values")]
    fn label_values_are_as_many_as_the_declared_labels() {
        gauge("vllm:num_requests_running").labelled(["m".to_string()]);
    }

    #[test]
    fn label_values_pair_with_the_declared_names_in_order() {
        let labels = gauge("vllm:cache_config_info")
            .labelled(["m", "0", "16", "int8", "8"].map(String::from));
        let names: Vec<&str> = labels.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "model_name",
                "engine",
                "block_size",
                "cache_dtype",
                "num_gpu_blocks"
            ]
        );
        assert_eq!(labels[2].1, "16");
    }

    #[test]
    fn a_malformed_declaration_is_an_error_naming_the_family() {
        let cases = [
            (
                r#"[{"name":"a_total","type":"counter","labels":[],"help":"h"}]"#,
                None,
            ),
            (
                r#"[{"name":"a","type":"counter","labels":[],"help":"h"}]"#,
                Some("_total"),
            ),
            (
                r#"[{"name":"a","type":"summary","labels":[],"help":"h"}]"#,
                Some("type"),
            ),
            (
                r#"[{"name":"a","type":"histogram","labels":[],"help":"h"}]"#,
                Some("buckets"),
            ),
            (
                r#"[{"name":"a","type":"gauge","labels":[1],"help":"h"}]"#,
                Some("label"),
            ),
            (r#"[{"name":"a","type":"gauge","labels":[]}]"#, Some("help")),
        ];
        for (text, error) in cases {
            match (parse(text), error) {
                (Ok(_), None) => {}
                (Err(e), Some(want)) => assert!(e.contains(want), "{text}: {e}"),
                (got, _) => panic!("{text}: {got:?}"),
            }
        }
    }
}
