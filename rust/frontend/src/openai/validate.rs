//! Request bodies checked the way the Python servers' pydantic models check them, so that a
//! bad request gets the same 400 from every API server of a fleet: a model is a list of
//! fields with their types, validated in order (lax, as pydantic is with parsed JSON: `"5"`
//! for an integer, `1` for a boolean), every error collected with pydantic's location and own
//! words, and the value given back with what the lax reading made of it. The locations are
//! then read as paths into the body as `app.py`'s `_validation_message` reads them (a union's
//! alternatives and a tagged union's tag left out) and joined by `fields::Invalid`, as the
//! chat routes' are. The body is first checked as plain data (`unrepresentable`, schema.py's
//! `RequestBody`).
//!
//! The chat routes read their fields one by one (`fields.rs`, over serde_json values); these
//! routes echo what they were given (tools, schemas, metadata) in its order and spelling, so
//! they read `pyjson` values, and their models are deeper, so they are declared as data.

use rankcast_frontend::pyjson::Json;

use super::chat_turn::ApiError;
use crate::fields::Invalid;

/// The largest integer the engine's wire and torch's seeds carry (schema.py's `INT_MAX`).
pub const INT_MAX: i128 = (1 << 63) - 1;

/// What FastAPI's validation says of a model given something other than an object.
const NOT_A_MODEL: &str = "Input should be a valid dictionary or object to extract fields from";

/// A field's type, as the pydantic model declares it.
pub enum Ty {
    Str,
    /// A string that must match a pattern, named in the error as pydantic writes it.
    Pattern(&'static str, fn(&str) -> bool),
    /// A string of at least this many characters.
    MinLen(usize),
    Int {
        ge: Option<i128>,
        le: Option<i128>,
    },
    Float {
        ge: Option<f64>,
        gt: Option<f64>,
        le: Option<f64>,
    },
    Bool,
    /// A boolean that must be false, with the validator's message when it is true.
    False(&'static str),
    /// `dict[str, Any]`.
    Dict,
    /// `dict[str, str]`.
    StrDict,
    /// A list of items of a type, with at least and at most so many.
    List(&'static Ty, usize, Option<usize>),
    /// One of these strings.
    Literal(&'static [&'static str]),
    /// A nested model: its fields.
    Model(&'static [Field]),
    /// The first alternative the value fits; otherwise every alternative's errors.
    Union(&'static [Ty]),
    /// A union told apart by a key's value (pydantic's discriminated union): the key, and the
    /// model of each value it may take.
    Tagged(&'static str, &'static [(&'static str, &'static [Field])]),
}

/// A field of a model: name, type, and whether it must be given and may be null.
pub struct Field {
    pub name: &'static str,
    pub ty: Ty,
    pub required: bool,
    pub nullable: bool,
}

/// A field that may be left out or null.
pub const fn optional(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        required: false,
        nullable: true,
    }
}

/// A field that must be given, and not as null.
pub const fn required(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        required: true,
        nullable: false,
    }
}

/// A field with a default that may not be null (`stream: bool = False`).
pub const fn defaulted(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        required: false,
        nullable: false,
    }
}

/// Where an error is, as pydantic's `loc`: keys (fields, and a tagged union's tag), indexes,
/// and the alternatives of unions.
#[derive(Clone)]
pub enum Loc {
    Key(String),
    Index(usize),
    Alternative,
}

/// Errors found so far: (where, message).
#[derive(Default)]
pub struct Errors(pub Vec<(Vec<Loc>, String)>);

impl Errors {
    fn push(&mut self, at: &[Loc], message: impl Into<String>) {
        self.0.push((at.to_vec(), message.into()));
    }

    /// The 400's message and the field it names first, as the Python servers write them for
    /// `body` (`app.py`'s `_validation_message`).
    pub fn message(&self, body: &Json) -> (String, Option<String>) {
        let mut invalid = Invalid::default();
        for (at, message) in &self.0 {
            invalid.add(body_path(at, body), message.as_str());
        }
        invalid.message()
    }
}

/// `_UNION_ALTERNATIVE`: the location parts that name a union's alternative (`str`,
/// `list[TextBlock]`, `UserMessage`) rather than a field; any key spelt so is taken for one.
fn names_an_alternative(part: &str) -> bool {
    let lower_bracketed = part.split_once('[').is_some_and(|(head, _)| {
        !head.is_empty() && head.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
    }) && part.ends_with(']');
    let word = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_');
    let capitalized = part.starts_with(|c: char| c.is_ascii_uppercase())
        && part.bytes().all(|b| b.is_ascii_alphanumeric());
    ["str", "int", "float", "bool", "none"].contains(&part)
        || part.strip_prefix("constrained-").is_some_and(word)
        || lower_bracketed
        || capitalized
}

/// `_body_path`: `at` as a path into `body`, union alternatives left out, and a tagged union's
/// tag (pydantic names the alternative by its tag's value, which is no key of the object) left
/// out once per object.
fn body_path(at: &[Loc], body: &Json) -> String {
    let mut path: Vec<String> = Vec::new();
    let mut node = Some(body);
    let mut tag_dropped = false;
    for part in at {
        let text = match part {
            Loc::Alternative => continue,
            Loc::Key(key) if names_an_alternative(key) => continue,
            Loc::Key(key) => key.clone(),
            Loc::Index(i) => i.to_string(),
        };
        let fields = match node {
            Some(Json::Object(fields)) => Some(fields),
            _ => None,
        };
        let is_key = matches!(part, Loc::Key(key) if fields.is_some_and(|f| f.iter().any(|(k, _)| k == key)));
        let is_value = |value: &Json| match (part, value) {
            (Loc::Key(key), Json::Str(s)) => key == s,
            (Loc::Index(i), Json::Int(digits)) => *digits == i.to_string(),
            _ => false,
        };
        if let (Some(fields), false, false) = (fields, is_key, tag_dropped) {
            if fields.iter().any(|(_, value)| is_value(value)) {
                tag_dropped = true;
                continue;
            }
        }
        path.push(text);
        node = match (part, node) {
            (Loc::Key(key), Some(value)) if is_key => value.get(key),
            (Loc::Index(i), Some(Json::Array(items))) => items.get(*i),
            _ => None,
        };
        tag_dropped = false;
    }
    path.join(".")
}

fn key(at: &[Loc], name: &str) -> Vec<Loc> {
    let mut at = at.to_vec();
    at.push(Loc::Key(name.to_string()));
    at
}

fn index(at: &[Loc], i: usize) -> Vec<Loc> {
    let mut at = at.to_vec();
    at.push(Loc::Index(i));
    at
}

/// `body` as a model with `fields` (a model's own after its base's: `parts`): the value as
/// validated (absent fields left out), or the 400 naming every error. A body that is not plain
/// data fails first, on its own (`unrepresentable`).
pub fn model(parts: &[&[Field]], body: &Json) -> Result<Json, ApiError> {
    let mut errors = Errors::default();
    if let Some(problem) = unrepresentable(body) {
        return Err(ApiError::bad(problem, None));
    }
    let Json::Object(_) = body else {
        return Err(ApiError::bad(NOT_A_MODEL, None));
    };
    let value = fields_of(parts, body, &[], &mut errors);
    if errors.0.is_empty() {
        return Ok(value);
    }
    let (message, param) = errors.message(body);
    Err(ApiError::bad(message, param.as_deref()))
}

fn fields_of(parts: &[&[Field]], body: &Json, at: &[Loc], errors: &mut Errors) -> Json {
    let mut out = Vec::new();
    let fields = || parts.iter().flat_map(|part| part.iter());
    for field in fields() {
        let here = key(at, field.name);
        match body.get(field.name) {
            None if field.required => errors.push(&here, "Field required"),
            None => {}
            Some(Json::Null) if field.nullable => out.push((field.name.to_string(), Json::Null)),
            Some(value) => {
                if let Some(valid) = check(&field.ty, value, &here, errors) {
                    out.push((field.name.to_string(), valid));
                }
            }
        }
    }
    // Fields the model does not declare are kept as given (they are ignored or allowed).
    if let Json::Object(given) = body {
        for (name, value) in given {
            if !fields().any(|f| f.name == name) {
                out.push((name.clone(), value.clone()));
            }
        }
    }
    Json::Object(out)
}

/// The whole number `x` is, written as pydantic writes a bound (`2` for 2.0).
fn bound(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{}", x as i64)
    } else {
        rankcast_frontend::pyjson::float_repr(x)
    }
}

fn check(ty: &Ty, value: &Json, at: &[Loc], errors: &mut Errors) -> Option<Json> {
    let before = errors.0.len();
    let valid = match ty {
        Ty::Str => match value {
            Json::Str(_) => Some(value.clone()),
            _ => fail(errors, at, "Input should be a valid string"),
        },
        Ty::Pattern(pattern, fits) => match value {
            Json::Str(s) if fits(s) => Some(value.clone()),
            Json::Str(_) => fail(
                errors,
                at,
                format!("String should match pattern '{pattern}'"),
            ),
            _ => fail(errors, at, "Input should be a valid string"),
        },
        Ty::MinLen(least) => match value {
            Json::Str(s) if s.chars().count() >= *least => Some(value.clone()),
            Json::Str(_) => {
                let unit = if *least == 1 {
                    "character"
                } else {
                    "characters"
                };
                fail(
                    errors,
                    at,
                    format!("String should have at least {least} {unit}"),
                )
            }
            _ => fail(errors, at, "Input should be a valid string"),
        },
        Ty::Int { ge, le } => integer(value, at, errors).and_then(|n| {
            if let Some(ge) = ge.filter(|ge| n < *ge) {
                return fail(
                    errors,
                    at,
                    format!("Input should be greater than or equal to {ge}"),
                );
            }
            if let Some(le) = le.filter(|le| n > *le) {
                return fail(
                    errors,
                    at,
                    format!("Input should be less than or equal to {le}"),
                );
            }
            Some(Json::Int(n.to_string()))
        }),
        Ty::Float { ge, gt, le } => number(value, at, errors).and_then(|x| {
            if let Some(ge) = ge.filter(|ge| x < *ge) {
                let message = format!("Input should be greater than or equal to {}", bound(ge));
                return fail(errors, at, message);
            }
            if let Some(gt) = gt.filter(|gt| x <= *gt) {
                let message = format!("Input should be greater than {}", bound(gt));
                return fail(errors, at, message);
            }
            if let Some(le) = le.filter(|le| x > *le) {
                let message = format!("Input should be less than or equal to {}", bound(le));
                return fail(errors, at, message);
            }
            Some(Json::Float(x))
        }),
        Ty::Bool => boolean(value, at, errors).map(Json::Bool),
        Ty::False(message) => match boolean(value, at, errors) {
            Some(true) => fail(errors, at, *message),
            valid => valid.map(Json::Bool),
        },
        Ty::Dict => match value {
            Json::Object(_) => Some(value.clone()),
            _ => fail(errors, at, "Input should be a valid dictionary"),
        },
        Ty::StrDict => match value {
            Json::Object(fields) => {
                for (name, item) in fields {
                    if !matches!(item, Json::Str(_)) {
                        errors.push(&key(at, name), "Input should be a valid string");
                    }
                }
                Some(value.clone())
            }
            _ => fail(errors, at, "Input should be a valid dictionary"),
        },
        Ty::List(item, least, most) => match value {
            Json::Array(items) => {
                let valid: Vec<Option<Json>> = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| check(item, v, &index(at, i), errors))
                    .collect();
                if errors.0.len() == before && items.len() < *least {
                    let message = format!(
                        "List should have at least {least} item after validation, not {}",
                        items.len()
                    );
                    return fail(errors, at, message);
                }
                if let Some(most) = most.filter(|most| items.len() > *most) {
                    let message = format!(
                        "List should have at most {most} items after validation, not {}",
                        items.len()
                    );
                    return fail(errors, at, message);
                }
                valid
                    .into_iter()
                    .collect::<Option<Vec<Json>>>()
                    .map(Json::Array)
            }
            _ => fail(errors, at, "Input should be a valid list"),
        },
        Ty::Literal(options) => match value {
            Json::Str(s) if options.contains(&s.as_str()) => Some(value.clone()),
            _ => fail(errors, at, literal_message(options)),
        },
        Ty::Model(fields) => match value {
            Json::Object(_) => Some(fields_of(&[fields], value, at, errors)),
            _ => fail(errors, at, NOT_A_MODEL),
        },
        Ty::Union(alternatives) => {
            let mut tried = Errors::default();
            let mut here = at.to_vec();
            here.push(Loc::Alternative);
            for alternative in alternatives.iter() {
                let mut own = Errors::default();
                if let Some(valid) = check(alternative, value, &here, &mut own) {
                    if own.0.is_empty() {
                        return Some(valid);
                    }
                }
                tried.0.extend(own.0);
            }
            errors.0.extend(tried.0);
            None
        }
        Ty::Tagged(discriminator, models) => {
            let Json::Object(_) = value else {
                return fail(errors, at, NOT_A_MODEL);
            };
            let tag = match value.get(discriminator) {
                None | Some(Json::Null) => {
                    let message =
                        format!("Unable to extract tag using discriminator '{discriminator}'");
                    return fail(errors, at, message);
                }
                Some(Json::Str(tag)) => tag.clone(),
                Some(other) => other.repr(),
            };
            let Some((_, fields)) = models.iter().find(|(name, _)| *name == tag) else {
                let expected: Vec<String> =
                    models.iter().map(|(name, _)| format!("'{name}'")).collect();
                let message = format!(
                    "Input tag '{tag}' found using '{discriminator}' does not match any of the \
                     expected tags: {}",
                    expected.join(", ")
                );
                return fail(errors, at, message);
            };
            Some(fields_of(&[fields], value, &key(at, &tag), errors))
        }
    };
    (errors.0.len() == before).then_some(valid).flatten()
}

fn fail<T>(errors: &mut Errors, at: &[Loc], message: impl Into<String>) -> Option<T> {
    errors.push(at, message);
    None
}

/// pydantic's words for a value outside a `Literal`: `'a', 'b' or 'c'`.
pub fn literal_message(options: &[&str]) -> String {
    let quoted: Vec<String> = options.iter().map(|o| format!("'{o}'")).collect();
    let listed = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => quoted.join(""),
    };
    format!("Input should be {listed}")
}

fn integer(value: &Json, at: &[Loc], errors: &mut Errors) -> Option<i128> {
    match value {
        Json::Int(digits) => digits.parse().ok(),
        Json::Bool(b) => Some(i128::from(*b)),
        Json::Float(x) if x.fract() == 0.0 && x.abs() < 9.3e18 => Some(*x as i128),
        Json::Float(x) if x.fract() == 0.0 => fail(
            errors,
            at,
            "Unable to parse input string as an integer, exceeded maximum size",
        ),
        Json::Float(_) => fail(
            errors,
            at,
            "Input should be a valid integer, got a number with a fractional part",
        ),
        Json::Str(s) => {
            let text = s.trim();
            let parsed = text.parse::<i128>().ok().or_else(|| {
                // "5.0" is an integer to pydantic; "5.5" is not.
                let x = text.parse::<f64>().ok().filter(|x| x.is_finite())?;
                (x.fract() == 0.0 && text.contains('.') && !text.contains(['e', 'E']))
                    .then_some(x as i128)
            });
            match parsed {
                Some(n) => Some(n),
                None => fail(
                    errors,
                    at,
                    "Input should be a valid integer, unable to parse string as an integer",
                ),
            }
        }
        _ => fail(errors, at, "Input should be a valid integer"),
    }
}

fn number(value: &Json, at: &[Loc], errors: &mut Errors) -> Option<f64> {
    let x = match value {
        Json::Int(digits) => digits.parse::<f64>().ok()?,
        Json::Float(x) => *x,
        Json::Bool(b) => f64::from(u8::from(*b)),
        Json::Str(s) => match s.trim().to_ascii_lowercase().parse::<f64>() {
            Ok(x) => x,
            Err(_) => {
                return fail(
                    errors,
                    at,
                    "Input should be a valid number, unable to parse string as a number",
                )
            }
        },
        _ => return fail(errors, at, "Input should be a valid number"),
    };
    if !x.is_finite() {
        return fail(errors, at, "Input should be a finite number");
    }
    Some(x)
}

fn boolean(value: &Json, at: &[Loc], errors: &mut Errors) -> Option<bool> {
    const UNABLE: &str = "Input should be a valid boolean, unable to interpret input";
    match value {
        Json::Bool(b) => Some(*b),
        Json::Int(digits) => match digits.as_str() {
            "0" => Some(false),
            "1" => Some(true),
            _ => fail(errors, at, UNABLE),
        },
        Json::Float(x) if *x == 0.0 => Some(false),
        Json::Float(x) if *x == 1.0 => Some(true),
        Json::Str(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => fail(errors, at, UNABLE),
        },
        _ => fail(errors, at, "Input should be a valid boolean"),
    }
}

/// Why a parsed body holds something no part of the engine can carry, naming where (schema.py's
/// `unrepresentable`): an integer outside 64 bits, a number that is not finite.
pub fn unrepresentable(body: &Json) -> Option<String> {
    fn walk(value: &Json, at: &str) -> Option<String> {
        match value {
            Json::Int(digits) => {
                let fits = digits
                    .parse::<i128>()
                    .is_ok_and(|n| (-(1i128 << 63)..=(1i128 << 64) - 1).contains(&n));
                (!fits).then(|| format!("{at}: integer outside the 64-bit range"))
            }
            Json::Float(x) if !x.is_finite() => Some(format!(
                "{at}: {} is not a finite number (NaN and infinities are refused)",
                Json::Float(*x).repr()
            )),
            Json::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, item)| walk(item, &format!("{at}[{i}]"))),
            Json::Object(fields) => fields.iter().find_map(|(name, item)| {
                let here = if at == "body" {
                    name.clone()
                } else {
                    format!("{at}.{name}")
                };
                walk(item, &here)
            }),
            _ => None,
        }
    }
    walk(body, "body")
}

/// A request's body as `json.loads` reads it, or the 400 FastAPI gives (an empty body is a
/// missing one).
pub async fn body_of(request: hyper::Request<hyper::Body>) -> Result<Json, ApiError> {
    let bytes = hyper::body::to_bytes(request.into_body())
        .await
        .map_err(|e| ApiError::bad(format!("reading the body: {e}"), None))?;
    if bytes.is_empty() {
        return Err(ApiError::bad("Field required", None));
    }
    let parsed = std::str::from_utf8(&bytes).ok().and_then(Json::parse);
    parsed.ok_or_else(|| ApiError::bad("Invalid JSON body: JSON decode error", None))
}

/// A string field of a validated model (None: absent or null).
pub fn string(value: &Json, key: &str) -> Option<String> {
    match value.get(key) {
        Some(Json::Str(s)) => Some(s.clone()),
        _ => None,
    }
}

pub fn integer_field(value: &Json, key: &str) -> Option<i64> {
    match value.get(key) {
        Some(Json::Int(digits)) => digits.parse().ok(),
        _ => None,
    }
}

pub fn float_field(value: &Json, key: &str) -> Option<f64> {
    match value.get(key) {
        Some(Json::Float(x)) => Some(*x),
        _ => None,
    }
}

pub fn bool_field(value: &Json, key: &str) -> Option<bool> {
    match value.get(key) {
        Some(Json::Bool(b)) => Some(*b),
        _ => None,
    }
}

/// A field's value unless absent or null.
pub fn given<'a>(value: &'a Json, key: &str) -> Option<&'a Json> {
    value.get(key).filter(|v| !v.is_null())
}

/// `^[A-Za-z0-9_-]{1,64}$`: a tool's name.
pub fn tool_name(name: &str) -> bool {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    (1..=64).contains(&name.len()) && name.chars().all(valid)
}

pub const TOOL_NAME: Ty = Ty::Pattern("^[A-Za-z0-9_-]{1,64}$", tool_name);

#[cfg(test)]
mod tests {
    use super::{literal_message, model, optional, required, Field, Ty, NOT_A_MODEL};
    use rankcast_frontend::pyjson::Json;

    const BLOCK: &[Field] = &[
        required("type", Ty::Literal(&["text"])),
        required("text", Ty::Str),
    ];
    const FIELDS: &[Field] = &[
        required("input", Ty::Union(&[Ty::Str, Ty::List(&Ty::Dict, 0, None)])),
        optional(
            "max_output_tokens",
            Ty::Int {
                ge: Some(1),
                le: Some(super::INT_MAX),
            },
        ),
        optional(
            "temperature",
            Ty::Float {
                ge: Some(0.0),
                gt: None,
                le: Some(2.0),
            },
        ),
        optional(
            "blocks",
            Ty::List(&Ty::Tagged("type", &[("text", BLOCK)]), 0, Some(2)),
        ),
        optional("metadata", Ty::StrDict),
    ];

    fn errors(body: &str) -> String {
        match model(&[FIELDS], &Json::parse(body).unwrap()) {
            Ok(value) => value.response(),
            Err(error) => error.message,
        }
    }

    #[test]
    fn errors_are_pydantics_at_the_python_servers_paths() {
        assert_eq!(errors("{}"), "input: Field required");
        assert_eq!(
            errors(r#"{"input": 5, "temperature": 3}"#),
            "input: Input should be a valid string; input: Input should be a valid list; \
             temperature: Input should be less than or equal to 2"
        );
        // The deepest failure of a union's alternatives is the one named.
        assert_eq!(
            errors(r#"{"input": [1], "max_output_tokens": 0}"#),
            "input.0: Input should be a valid dictionary; max_output_tokens: Input should be \
             greater than or equal to 1"
        );
        assert_eq!(
            errors(r#"{"input": "x", "max_output_tokens": "7", "temperature": 0}"#),
            r#"{"input":"x","max_output_tokens":7,"temperature":0.0}"#
        );
        assert_eq!(
            errors(r#"{"input": "x", "temperature": NaN}"#),
            "temperature: nan is not a finite number (NaN and infinities are refused)"
        );
        assert_eq!(errors("[]"), NOT_A_MODEL);
        // A tagged union: the tag is no part of the path, unless it is also a key there.
        assert_eq!(
            errors(r#"{"input": "x", "blocks": [{"type": "text"}, {"type": "text", "text": 5}]}"#),
            "blocks.0.text: Field required; blocks.1.text.text: Input should be a valid string"
        );
        assert_eq!(
            errors(r#"{"input": "x", "blocks": [{"type": "image"}, {}, 1]}"#),
            "blocks.0: Input tag 'image' found using 'type' does not match any of the expected \
             tags: 'text'; blocks.1: Unable to extract tag using discriminator 'type'; blocks.2: \
             Input should be a valid dictionary or object to extract fields from"
        );
        assert_eq!(
            errors(
                r#"{"input": "x", "blocks": [{"type": "text", "text": ""}, {"type": "text", "text": ""}, {"type": "text", "text": ""}]}"#
            ),
            "blocks: List should have at most 2 items after validation, not 3"
        );
        // A key spelt as an alternative's name is left out of the path, as Python leaves it.
        assert_eq!(
            errors(r#"{"input": "x", "metadata": {"Key": 1, "k": 2}}"#),
            "metadata.k: Input should be a valid string"
        );
        assert_eq!(
            literal_message(&["none", "auto", "required"]),
            "Input should be 'none', 'auto' or 'required'"
        );
    }
}
