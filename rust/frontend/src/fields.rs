//! Request fields read as the Python servers' pydantic models read them
//! (`rankcast/api_server/schema.py`), so that a mixed fleet refuses a bad body with the same
//! 400 from either kind of server: pydantic's lax conversions (`"yes"` is a boolean, `7.0` an
//! integer), its messages, and every failing field named in declaration order, joined as the
//! Python servers join them (`app.py`'s `_validation_message`).

use serde_json::{Map, Value};

const NOT_A_BOOLEAN: &str = "Input should be a valid boolean";
const NOT_AN_INTEGER: &str = "Input should be a valid integer";
const NOT_A_STRING: &str = "Input should be a valid string";
const NOT_A_LIST: &str = "Input should be a valid list";
const NOT_A_DICTIONARY: &str = "Input should be a valid dictionary";
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

    /// The 400's message (`location: message; ...`) and the field it names first.
    pub fn message(&self) -> (String, Option<String>) {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(at, message)| {
                if at.is_empty() {
                    message.clone()
                } else {
                    format!("{at}: {message}")
                }
            })
            .collect();
        let param = self.0.iter().map(|(at, _)| at).find(|at| !at.is_empty());
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

/// `list[int]`, each failing item named by its index.
pub fn integers(invalid: &mut Invalid, key: &str, value: &Value) -> Vec<i64> {
    let Some(items) = value.as_array() else {
        invalid.add(key, NOT_A_LIST);
        return Vec::new();
    };
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match integer(item) {
            Ok(id) => ids.push(id),
            Err(message) => invalid.add(format!("{key}.{i}"), message),
        }
    }
    ids
}

/// One chat message as the Python servers' `ChatMessage` holds it: its role, and its content
/// as given (text, a list of parts, or none).
pub struct Message {
    pub role: String,
    content: Value,
}

impl Message {
    /// The message's text (`ChatMessage.text`): no content is empty text, parts other than
    /// text are refused, naming their type as Python's `repr` writes it.
    pub fn text(&self) -> Result<String, String> {
        let parts = match &self.content {
            Value::Null => return Ok(String::new()),
            Value::String(text) => return Ok(text.clone()),
            Value::Array(parts) => parts,
            _ => unreachable!("content was checked to be text, a list or none"),
        };
        let mut text = String::new();
        for part in parts {
            let kind = part.get("type");
            if kind.and_then(Value::as_str) != Some("text") {
                return Err(format!(
                    "content part type {} is not supported",
                    python_repr(kind.unwrap_or(&Value::Null))
                ));
            }
            match part.get("text") {
                None => {}
                Some(Value::String(s)) => text.push_str(s),
                Some(other) => text.push_str(&python_repr(other)),
            }
        }
        Ok(text)
    }
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
            let message = "Input should be a valid dictionary or instance of ChatMessage";
            invalid.add(at, message);
            continue;
        };
        let role = match fields.get("role") {
            None => {
                invalid.add(format!("{at}.role"), "Field required");
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
        let content = fields.get("content").cloned().unwrap_or(Value::Null);
        let content_fits = match &content {
            Value::Null | Value::String(_) => true,
            Value::Array(parts) => {
                let not_objects: Vec<usize> = (0..parts.len())
                    .filter(|&p| !parts[p].is_object())
                    .collect();
                if !not_objects.is_empty() {
                    invalid.add(format!("{at}.content.str"), NOT_A_STRING);
                }
                for &p in &not_objects {
                    let place = format!("{at}.content.list[dict[str,any]].{p}");
                    invalid.add(place, NOT_A_DICTIONARY);
                }
                not_objects.is_empty()
            }
            _ => {
                invalid.add(format!("{at}.content.str"), NOT_A_STRING);
                invalid.add(format!("{at}.content.list[dict[str,any]]"), NOT_A_LIST);
                false
            }
        };
        if let (Some(role), true) = (role, content_fits) {
            messages.push(Message { role, content });
        }
    }
    messages
}

/// `repr(value)` of the Python value JSON `value` reads as, for the few kinds a message names.
fn python_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => {
            let quote = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            let mut out = String::from(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        out.push_str(&format!("\\x{:02x}", c as u32));
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
            out
        }
        other => other.to_string(),
    }
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
    fn every_failing_field_is_named_in_order_and_the_first_is_the_param() {
        let mut invalid = Invalid::default();
        let body = json!([{"role": "bot"}, {"role": "user", "content": 5}]);
        assert!(messages(&mut invalid, "messages", &body, 0).is_empty());
        let (message, param) = invalid.message();
        assert_eq!(param.as_deref(), Some("messages.0.role"));
        assert_eq!(
            message,
            "messages.0.role: Input should be 'system', 'user', 'assistant', 'tool' or \
             'developer'; messages.1.content.str: Input should be a valid string; \
             messages.1.content.list[dict[str,any]]: Input should be a valid list"
        );
    }

    #[test]
    fn a_part_other_than_text_is_named_as_python_writes_it() {
        let mut invalid = Invalid::default();
        let parts = json!([{"role": "user", "content": [{"type": "image_url"}]}]);
        let found = messages(&mut invalid, "messages", &parts, 1);
        assert_eq!(
            found[0].text().unwrap_err(),
            "content part type 'image_url' is not supported"
        );
        let untyped = json!([{"role": "user", "content": [{"text": "a"}]}]);
        let found = messages(&mut invalid, "messages", &untyped, 1);
        assert_eq!(
            found[0].text().unwrap_err(),
            "content part type None is not supported"
        );
    }
}
