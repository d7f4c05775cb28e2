//! Request fields read as the Python servers' pydantic models read them
//! (`rankcast/api_server/schema.py`), so that a mixed fleet refuses a bad body with the same
//! 400 from either kind of server: pydantic's lax conversions (`"yes"` is a boolean, `7.0` an
//! integer), its messages, and every failing field named in declaration order by its path in
//! the body, joined as the Python servers join them (`app.py`'s `_validation_message`: of a
//! union's alternatives only the deepest failures, each message once).

use serde_json::{Map, Value};

const NOT_A_BOOLEAN: &str = "Input should be a valid boolean";
const NOT_AN_INTEGER: &str = "Input should be a valid integer";
const NOT_A_STRING: &str = "Input should be a valid string";
const NOT_A_LIST: &str = "Input should be a valid list";
const NOT_A_DICTIONARY: &str = "Input should be a valid dictionary";
const NOT_AN_OBJECT: &str = "Input should be a valid dictionary or object to extract fields from";
const MISSING: &str = "Field required";
const NEGATIVE: &str = "Input should be greater than or equal to 0";
const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// The fields that failed, each with pydantic's message, in the order they were checked.
#[derive(Default)]
pub struct Invalid(Vec<(String, String)>);

impl Invalid {
    pub fn add(&mut self, location: impl Into<String>, message: impl Into<String>) {
        self.0.push((location.into(), message.into()));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `key` missing from `object` at `at`. Where the object holds `key` as a value, the
    /// Python servers take the key for a tagged union's tag (pydantic names an alternative by
    /// its tag's value) and leave it out of the path; so does this.
    pub fn missing(&mut self, object: &Map<String, Value>, at: &str, key: &str) {
        let tag = object.values().any(|value| value.as_str() == Some(key));
        self.add(if tag { at.to_string() } else { join(at, key) }, MISSING);
    }

    /// The 400's message (`location: message; ...`) and the field it names first: a failure
    /// at a path that another failure lies below is left out (the alternatives of a union
    /// that failed less deep), and each part is said once.
    pub fn message(&self) -> (String, Option<String>) {
        let deeper: Vec<&(String, String)> = self
            .0
            .iter()
            .filter(|(at, _)| {
                at.is_empty()
                    || !self
                        .0
                        .iter()
                        .any(|(other, _)| other.starts_with(&format!("{at}.")))
            })
            .collect();
        let mut parts: Vec<String> = Vec::new();
        for (at, message) in &deeper {
            let part = if at.is_empty() {
                message.clone()
            } else {
                format!("{at}: {message}")
            };
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
        let param = deeper.iter().map(|(at, _)| at).find(|at| !at.is_empty());
        (parts.join("; "), param.cloned())
    }

    /// Read `key` of `body` with `read` (absent: `default`; `null` is a value `read` judges),
    /// recording a failure under `key`.
    pub fn field<T>(
        &mut self,
        body: &Map<String, Value>,
        key: &str,
        default: T,
        read: impl Fn(&Value) -> Result<T, &'static str>,
    ) -> T {
        match body.get(key).map(read) {
            None => default,
            Some(Ok(value)) => value,
            Some(Err(message)) => {
                self.add(key, message);
                default
            }
        }
    }
}

/// `bool` in lax mode: `true`/`false`, 0 and 1, and the words pydantic reads as either.
pub fn boolean(value: &Value) -> Result<bool, &'static str> {
    const UNREADABLE: &str = "Input should be a valid boolean, unable to interpret input";
    match value {
        Value::Bool(b) => Ok(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => Ok(false),
            Some(1.0) => Ok(true),
            _ if n.is_f64() => Err(NOT_A_BOOLEAN),
            _ => Err(UNREADABLE),
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Ok(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Ok(true),
            _ => Err(UNREADABLE),
        },
        _ => Err(NOT_A_BOOLEAN),
    }
}

/// `bool | None`.
pub fn optional_boolean(value: &Value) -> Result<Option<bool>, &'static str> {
    if value.is_null() {
        return Ok(None);
    }
    boolean(value).map(Some)
}

/// `int` in lax mode: integers, floats without a fraction, booleans and integer text.
pub fn integer(value: &Value) -> Result<i64, &'static str> {
    match value {
        Value::Bool(b) => Ok(i64::from(*b)),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Ok(i),
            (None, Some(x)) if x.fract() != 0.0 => {
                Err("Input should be a valid integer, got a number with a fractional part")
            }
            (None, Some(x)) if x.abs() < 9.2e18 => Ok(x as i64),
            _ => Err("integer outside the 64-bit range"),
        },
        Value::String(s) => {
            let text = s.trim();
            let whole = text.strip_suffix(".0").unwrap_or(text);
            whole.parse().map_err(|_| {
                "Input should be a valid integer, unable to parse string as an integer"
            })
        }
        _ => Err(NOT_AN_INTEGER),
    }
}

/// `str`: text only (pydantic converts nothing to text).
pub fn string(value: &Value) -> Result<String, &'static str> {
    value.as_str().map(str::to_string).ok_or(NOT_A_STRING)
}

/// `str | None`.
pub fn optional_string(value: &Value) -> Result<Option<String>, &'static str> {
    if value.is_null() {
        return Ok(None);
    }
    string(value).map(Some)
}

/// `dict[str, Any] | None`.
pub fn optional_object(value: &Value) -> Result<Option<Map<String, Value>>, &'static str> {
    match value {
        Value::Null => Ok(None),
        Value::Object(map) => Ok(Some(map.clone())),
        _ => Err(NOT_A_DICTIONARY),
    }
}

/// `list[TokenId]`: integers from 0, each failing item named by its index.
pub fn token_ids(invalid: &mut Invalid, key: &str, value: &Value) -> Vec<i64> {
    let Some(items) = value.as_array() else {
        invalid.add(key, NOT_A_LIST);
        return Vec::new();
    };
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match integer(item) {
            Ok(id) if id < 0 => invalid.add(format!("{key}.{i}"), NEGATIVE),
            Ok(id) => ids.push(id),
            Err(message) => invalid.add(format!("{key}.{i}"), message),
        }
    }
    ids
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    }
}

/// One chat message as the Python servers' `ChatMessage` holds it: its role, and its text
/// (no content is empty text, text parts are joined).
pub struct Message {
    pub role: String,
    pub text: String,
}

/// `list[ChatMessage]` under `key`, at least `at_least` of them.
pub fn messages(invalid: &mut Invalid, key: &str, value: &Value, at_least: usize) -> Vec<Message> {
    let Some(items) = value.as_array() else {
        invalid.add(key, NOT_A_LIST);
        return Vec::new();
    };
    if items.len() < at_least {
        let message = format!(
            "List should have at least {at_least} item after validation, not {}",
            items.len()
        );
        invalid.add(key, message);
        return Vec::new();
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{key}.{i}");
        let Some(fields) = item.as_object() else {
            invalid.add(at, NOT_AN_OBJECT);
            continue;
        };
        let role = match fields.get("role") {
            None => {
                invalid.missing(fields, &at, "role");
                None
            }
            Some(Value::String(role)) if ROLES.contains(&role.as_str()) => Some(role.clone()),
            Some(_) => {
                let message =
                    "Input should be 'system', 'user', 'assistant', 'tool' or 'developer'";
                invalid.add(format!("{at}.role"), message);
                None
            }
        };
        let text = content(invalid, &format!("{at}.content"), fields.get("content"));
        if let (Some(role), Some(text)) = (role, text) {
            messages.push(Message { role, text });
        }
    }
    messages
}

/// A message's `content`: text, a list of text parts (`TextPart`: `type` "text" and `text`),
/// or none; its text, None where it failed.
fn content(invalid: &mut Invalid, at: &str, value: Option<&Value>) -> Option<String> {
    let parts = match value {
        None | Some(Value::Null) => return Some(String::new()),
        Some(Value::String(text)) => return Some(text.clone()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            invalid.add(at, NOT_A_STRING);
            invalid.add(at, NOT_A_LIST);
            return None;
        }
    };
    let mut text = String::new();
    let mut fits = true;
    for (p, part) in parts.iter().enumerate() {
        let at = format!("{at}.{p}");
        let Some(fields) = part.as_object() else {
            invalid.add(at, NOT_AN_OBJECT);
            fits = false;
            continue;
        };
        match fields.get("type") {
            None => invalid.missing(fields, &at, "type"),
            Some(Value::String(kind)) if kind == "text" => {}
            Some(_) => invalid.add(format!("{at}.type"), "Input should be 'text'"),
        }
        match fields.get("text") {
            None => invalid.missing(fields, &at, "text"),
            Some(Value::String(piece)) => text.push_str(piece),
            Some(_) => invalid.add(format!("{at}.text"), NOT_A_STRING),
        }
        fits &= fields.get("type").and_then(Value::as_str) == Some("text")
            && fields.get("text").is_some_and(Value::is_string);
    }
    fits.then_some(text)
}

/// A completion's `prompt`: text, or the token ids to compute.
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

/// `prompt`, the union of the Python servers' `CompletionRequest`: non-empty text, token ids
/// (from 0), or a list of one non-empty text; what fails is named as that union's deepest
/// failures name it (a list of two or more is token ids or nothing).
pub fn prompt(invalid: &mut Invalid, body: &Map<String, Value>) -> Option<Prompt> {
    const AT: &str = "prompt";
    let items = match body.get(AT) {
        None => {
            invalid.missing(body, "", AT);
            return None;
        }
        Some(Value::String(text)) if text.is_empty() => {
            invalid.add(AT, "String should have at least 1 character");
            invalid.add(AT, NOT_A_LIST);
            return None;
        }
        Some(Value::String(text)) => return Some(Prompt::Text(text.clone())),
        Some(Value::Array(items)) => items,
        Some(_) => {
            invalid.add(AT, NOT_A_STRING);
            invalid.add(AT, NOT_A_LIST);
            return None;
        }
    };
    if items.is_empty() {
        invalid.add(AT, NOT_A_STRING);
        invalid.add(
            AT,
            "List should have at least 1 item after validation, not 0",
        );
        return None;
    }
    if let [Value::String(text)] = items.as_slice() {
        if !text.is_empty() {
            return Some(Prompt::Text(text.clone()));
        }
    }
    let before = invalid.0.len();
    let ids = token_ids(invalid, AT, &Value::Array(items.clone()));
    if invalid.0.len() == before {
        return Some(Prompt::Ids(ids));
    }
    if let [item] = items.as_slice() {
        let message = match item {
            Value::String(_) => "String should have at least 1 character",
            _ => NOT_A_STRING,
        };
        invalid.add(format!("{AT}.0"), message);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lax_booleans_and_integers_read_as_pydantic_reads_them() {
        assert_eq!(boolean(&json!("YES")), Ok(true));
        assert_eq!(boolean(&json!(0)), Ok(false));
        assert!(boolean(&json!(2))
            .unwrap_err()
            .ends_with("unable to interpret input"));
        assert_eq!(boolean(&json!(null)), Err(NOT_A_BOOLEAN));
        assert_eq!(integer(&json!(" 7 ")), Ok(7));
        assert_eq!(integer(&json!(7.0)), Ok(7));
        assert_eq!(integer(&json!(true)), Ok(1));
        assert!(integer(&json!(2.5))
            .unwrap_err()
            .ends_with("fractional part"));
    }

    #[test]
    fn every_failing_field_is_named_by_its_path_in_order_and_the_first_is_the_param() {
        let mut invalid = Invalid::default();
        let body = json!([{"role": "bot"}, {"role": "user", "content": 5}]);
        assert!(messages(&mut invalid, "messages", &body, 0).is_empty());
        let (message, param) = invalid.message();
        assert_eq!(param.as_deref(), Some("messages.0.role"));
        assert_eq!(
            message,
            "messages.0.role: Input should be 'system', 'user', 'assistant', 'tool' or \
             'developer'; messages.1.content: Input should be a valid string; \
             messages.1.content: Input should be a valid list"
        );
    }

    #[test]
    fn a_part_other_than_text_is_named_where_it_is_and_a_tag_is_no_key() {
        let mut invalid = Invalid::default();
        let parts = json!([{"role": "user", "content": [{"type": "image_url"}, {"type": "text"}]}]);
        assert!(messages(&mut invalid, "messages", &parts, 1).is_empty());
        assert_eq!(
            invalid.message().0,
            "messages.0.content.0.type: Input should be 'text'; messages.0.content.0.text: \
             Field required; messages.0.content.1: Field required"
        );
        let mut invalid = Invalid::default();
        let text = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
        let found = messages(&mut invalid, "messages", &text, 1);
        assert!(invalid.is_empty());
        assert_eq!(found[0].text, "ab");
    }

    #[test]
    fn a_prompt_is_text_token_ids_or_one_text_and_fails_as_its_union_does() {
        let read = |body: Value| {
            let mut invalid = Invalid::default();
            let body = body.as_object().cloned().expect("an object");
            let found = prompt(&mut invalid, &body);
            (
                found.map(|p| match p {
                    Prompt::Text(text) => text,
                    Prompt::Ids(ids) => format!("{ids:?}"),
                }),
                invalid.message().0,
            )
        };
        assert_eq!(read(json!({"prompt": ["5"]})).0.as_deref(), Some("5"));
        assert_eq!(
            read(json!({"prompt": [1.0, "2"]})).0.as_deref(),
            Some("[1, 2]")
        );
        assert_eq!(
            read(json!({"prompt": [""]})).1,
            "prompt.0: Input should be a valid integer, unable to parse string as an integer; \
             prompt.0: String should have at least 1 character"
        );
        assert_eq!(
            read(json!({"prompt": [5, -1, "x"]})).1,
            "prompt.1: Input should be greater than or equal to 0; prompt.2: Input should be a \
             valid integer, unable to parse string as an integer"
        );
        assert_eq!(
            read(json!({"prompt": []})).1,
            "prompt: Input should be a valid string; prompt: List should have at least 1 item \
             after validation, not 0"
        );
    }
}
