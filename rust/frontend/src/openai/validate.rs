//! Request bodies checked the way the Python servers' pydantic models check them, so that a
//! bad request gets the same 400 from every API server of a fleet: a model is a list of
//! fields with their types, validated in order (lax, as pydantic is with parsed JSON: `"5"`
//! for an integer, `1` for a boolean), every error collected with where it is (`tools.0.name`)
//! and pydantic's own words, and the value given back with what the lax reading made of it.
//! The body is first checked as plain data (`unrepresentable`, schema.py's `RequestBody`).

use rankcast_frontend::pyjson::Json;

use super::chat_turn::ApiError;

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
    List(&'static Ty, usize),
    /// One of these strings.
    Literal(&'static [&'static str]),
    /// A nested model: its fields.
    Model(&'static [Field]),
    /// The first member the value fits; otherwise every member's errors, each under the
    /// member's name as pydantic writes it (`str`, `list[dict[str,any]]`).
    Union(&'static [(&'static str, Ty)]),
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

/// Where an error is, as pydantic's `loc`.
#[derive(Clone)]
pub enum Loc {
    Key(String),
    Index(usize),
}

/// Errors found so far: (where, message).
#[derive(Default)]
pub struct Errors(pub Vec<(Vec<Loc>, String)>);

impl Errors {
    fn push(&mut self, at: &[Loc], message: impl Into<String>) {
        self.0.push((at.to_vec(), message.into()));
    }

    /// The 400's message and the field it names first, as the Python servers write them
    /// (`app.py`'s `_validation_message`).
    pub fn message(&self) -> (String, Option<String>) {
        let mut parts = Vec::new();
        let mut param = None;
        for (at, message) in &self.0 {
            let location = dotted(at);
            if location.is_empty() {
                parts.push(message.clone());
            } else {
                parts.push(format!("{location}: {message}"));
                param.get_or_insert(location);
            }
        }
        (parts.join("; "), param)
    }
}

/// A location written as pydantic's error locations are joined (`input.0.content`).
pub fn dotted(at: &[Loc]) -> String {
    let parts: Vec<String> = at
        .iter()
        .map(|loc| match loc {
            Loc::Key(key) => key.clone(),
            Loc::Index(i) => i.to_string(),
        })
        .collect();
    parts.join(".")
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
/// validated (absent fields left out), or every error. A body that is not plain data fails
/// first, on its own (`unrepresentable`).
pub fn model(parts: &[&[Field]], body: &Json) -> Result<Json, Errors> {
    let mut errors = Errors::default();
    if let Some(problem) = unrepresentable(body) {
        errors.push(&[], problem);
        return Err(errors);
    }
    let Json::Object(_) = body else {
        errors.push(&[], NOT_A_MODEL);
        return Err(errors);
    };
    let value = fields_of(parts, body, &[], &mut errors);
    if errors.0.is_empty() {
        Ok(value)
    } else {
        Err(errors)
    }
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
        Ty::List(item, least) => match value {
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
        Ty::Union(members) => {
            let mut tried = Errors::default();
            for (name, member) in members.iter() {
                let mut own = Errors::default();
                if let Some(valid) = check(member, value, &key(at, name), &mut own) {
                    if own.0.is_empty() {
                        return Some(valid);
                    }
                }
                tried.0.extend(own.0);
            }
            errors.0.extend(tried.0);
            None
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

/// A validation failure as the 400 the Python servers give.
impl From<Errors> for ApiError {
    fn from(errors: Errors) -> ApiError {
        let (message, param) = errors.message();
        ApiError::bad(message, param.as_deref())
    }
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
    use super::{literal_message, model, optional, required, Ty};
    use rankcast_frontend::pyjson::Json;

    const FIELDS: &[super::Field] = &[
        required(
            "input",
            Ty::Union(&[
                ("str", Ty::Str),
                ("list[dict[str,any]]", Ty::List(&Ty::Dict, 0)),
            ]),
        ),
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
    ];

    fn errors(body: &str) -> String {
        match model(&[FIELDS], &Json::parse(body).unwrap()) {
            Ok(value) => value.response(),
            Err(errors) => errors.message().0,
        }
    }

    #[test]
    fn errors_are_pydantics() {
        assert_eq!(errors("{}"), "input: Field required");
        assert_eq!(
            errors(r#"{"input": 5, "temperature": 3}"#),
            "input.str: Input should be a valid string; input.list[dict[str,any]]: Input should \
             be a valid list; temperature: Input should be less than or equal to 2"
        );
        assert_eq!(
            errors(r#"{"input": [1], "max_output_tokens": 0}"#),
            "input.str: Input should be a valid string; input.list[dict[str,any]].0: Input \
             should be a valid dictionary; max_output_tokens: Input should be greater than or \
             equal to 1"
        );
        assert_eq!(
            errors(r#"{"input": "x", "max_output_tokens": "7", "temperature": 0}"#),
            r#"{"input":"x","max_output_tokens":7,"temperature":0.0}"#
        );
        assert_eq!(
            errors(r#"{"input": "x", "temperature": NaN}"#),
            "temperature: nan is not a finite number (NaN and infinities are refused)"
        );
        assert_eq!(errors("[]"), super::NOT_A_MODEL);
        assert_eq!(
            literal_message(&["none", "auto", "required"]),
            "Input should be 'none', 'auto' or 'required'"
        );
    }
}
