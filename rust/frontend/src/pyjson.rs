//! JSON as Python writes it, for the places where this server must give the Python servers'
//! bytes, not just their values:
//!
//! - A tool call's `arguments` are the object the model wrote, read by `json.loads` and written
//!   again by `json.dumps(..., ensure_ascii=False)`: keys in the order written (a repeated key
//!   keeps its first place and its last value), `", "` and `": "`, integers of any size as
//!   their digits, floats as Python's `repr` spells them (`1e-05`, `1e+16`, `100.0`), `NaN`
//!   and `Infinity` read and written. serde_json sorts keys and spells floats otherwise.
//! - Responses keep the Python servers' field order (`id`, `object`, `created`, ...), where
//!   serde_json's maps would sort it: `Json::response` writes a whole response as FastAPI's
//!   `JSONResponse` does (`json.dumps`, compact), `Json::event` a streamed chunk as msgspec
//!   does (compact, floats spelt `0.00001` and `1e-6`, `1e16`; NaN and infinities `null`).
//!
//! Strings are escaped as all three Python encoders escape them (`\"`, `\\`, `\b\f\n\r\t`,
//! other control characters as `\u00xx`, everything else as it is), which is serde_json's
//! escaping too; `Json::dumps_ascii` as `json.dumps` does by default (beyond ASCII as `\uxxxx`).
//! `Json::repr` is Python's `repr` of the value, as error messages quote what a client sent.

use std::collections::HashMap;
use std::fmt::Write;

/// How one of Python's encoders writes: separators, and whose float spelling.
struct Style {
    comma: &'static str,
    colon: &'static str,
    msgspec: bool,
    /// `ensure_ascii=True`: every character beyond printable ASCII as a `\u` escape.
    ascii: bool,
}

impl Style {
    const DUMPS: Style = Style {
        comma: ", ",
        colon: ": ",
        msgspec: false,
        ascii: false,
    };
    const DUMPS_ASCII: Style = Style {
        comma: ", ",
        colon: ": ",
        msgspec: false,
        ascii: true,
    };
    const RESPONSE: Style = Style {
        comma: ",",
        colon: ":",
        msgspec: false,
        ascii: false,
    };
    const EVENT: Style = Style {
        comma: ",",
        colon: ":",
        msgspec: true,
        ascii: false,
    };
}

/// A JSON value with its object keys in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// An integer as its decimal digits: Python's integers have no size limit.
    Int(String),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    /// Keys in the order written, as Python's dicts keep them.
    Object(Vec<(String, Json)>),
}

/// Python refuses to convert integers of more digits than this (`sys.int_info`), so
/// `json.loads` fails on them; so does `parse`.
const MAX_INT_DIGITS: usize = 4300;
/// Python's parser recurses per level and fails near its recursion limit (a `RecursionError`,
/// which the Python servers do not catch); this one gives up well before its stack would.
const MAX_DEPTH: usize = 500;

impl Json {
    /// `json.loads(text)`: None where Python raises (a string must be valid Unicode here, so a
    /// lone `\ud800` escape, which Python keeps as a lone surrogate, is refused too).
    pub fn parse(text: &str) -> Option<Json> {
        let mut reader = Reader {
            text: text.as_bytes(),
            at: 0,
            depth: 0,
        };
        reader.space();
        let value = reader.value()?;
        reader.space();
        (reader.at == reader.text.len()).then_some(value)
    }

    /// `json.dumps(self, ensure_ascii=False)`.
    pub fn dumps(&self) -> String {
        self.text(&Style::DUMPS)
    }

    /// `json.dumps(self)`: Python's default, with `ensure_ascii` (what the Python servers write
    /// a forced tool call's arguments with).
    pub fn dumps_ascii(&self) -> String {
        self.text(&Style::DUMPS_ASCII)
    }

    /// A whole response as the Python servers write one (`JSONResponse`: `json.dumps` with
    /// `separators=(",", ":")`).
    pub fn response(&self) -> String {
        self.text(&Style::RESPONSE)
    }

    /// A streamed event's JSON as the Python servers write it (msgspec).
    pub fn event(&self) -> String {
        self.text(&Style::EVENT)
    }

    fn text(&self, style: &Style) -> String {
        let mut out = String::new();
        self.write(&mut out, style);
        out
    }

    /// Python's `repr` of the value `json.loads` gives (`None`, `True`, `'text'`, `[1, 2.5]`,
    /// `{'a': 1}`).
    pub fn repr(&self) -> String {
        match self {
            Json::Null => "None".into(),
            Json::Bool(b) => if *b { "True" } else { "False" }.into(),
            Json::Int(digits) => digits.clone(),
            Json::Float(x) if x.is_nan() => "nan".into(),
            Json::Float(x) if x.is_infinite() => if *x > 0.0 { "inf" } else { "-inf" }.into(),
            Json::Float(x) => float_repr(*x),
            Json::Str(s) => str_repr(s),
            Json::Array(items) => {
                let items: Vec<String> = items.iter().map(Json::repr).collect();
                format!("[{}]", items.join(", "))
            }
            Json::Object(fields) => {
                let fields: Vec<String> = fields
                    .iter()
                    .map(|(key, value)| format!("{}: {}", str_repr(key), value.repr()))
                    .collect();
                format!("{{{}}}", fields.join(", "))
            }
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// An object with the value at `key` replaced by `value`, in its place (other values as
    /// they are).
    pub fn with(self, key: &str, value: Json) -> Json {
        let Json::Object(fields) = self else {
            return self;
        };
        let mut value = Some(value);
        let fields = fields
            .into_iter()
            .map(|(k, v)| {
                let v = if k == key {
                    value.take().unwrap_or(v)
                } else {
                    v
                };
                (k, v)
            })
            .collect();
        Json::Object(fields)
    }

    /// The value at `key` of an object (None for other values and missing keys).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn write(&self, out: &mut String, style: &Style) {
        let Style {
            comma,
            colon,
            msgspec,
            ascii,
        } = *style;
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(digits) => out.push_str(digits),
            Json::Float(x) if msgspec => out.push_str(&float_msgspec(*x)),
            Json::Float(x) => out.push_str(&float_repr(*x)),
            Json::Str(s) => write_str(out, s, ascii),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(comma);
                    }
                    item.write(out, style);
                }
                out.push(']');
            }
            Json::Object(fields) => {
                out.push('{');
                for (i, (key, value)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push_str(comma);
                    }
                    write_str(out, key, ascii);
                    out.push_str(colon);
                    value.write(out, style);
                }
                out.push('}');
            }
        }
    }
}

impl From<&str> for Json {
    fn from(s: &str) -> Json {
        Json::Str(s.to_string())
    }
}

impl From<String> for Json {
    fn from(s: String) -> Json {
        Json::Str(s)
    }
}

impl From<bool> for Json {
    fn from(b: bool) -> Json {
        Json::Bool(b)
    }
}

impl From<f64> for Json {
    fn from(x: f64) -> Json {
        Json::Float(x)
    }
}

macro_rules! from_integer {
    ($($t:ty),*) => {$(
        impl From<$t> for Json {
            fn from(n: $t) -> Json {
                Json::Int(n.to_string())
            }
        }
    )*};
}
from_integer!(i64, u64, usize, u8, u16, u32);

impl<T: Into<Json>> From<Option<T>> for Json {
    fn from(value: Option<T>) -> Json {
        value.map_or(Json::Null, Into::into)
    }
}

impl<T: Into<Json>> From<Vec<T>> for Json {
    fn from(items: Vec<T>) -> Json {
        Json::Array(items.into_iter().map(Into::into).collect())
    }
}

/// An object with its keys in the order given: `object![("id", id), ("object", "chat")]`.
#[macro_export]
macro_rules! object {
    ($(($key:expr, $value:expr)),* $(,)?) => {
        $crate::pyjson::Json::Object(vec![$(($key.to_string(), $crate::pyjson::Json::from($value))),*])
    };
}

fn write_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a string: in single quotes unless it holds one and no double quote,
/// backslashes, the quote and control characters escaped, and what Python deems unprintable
/// (separators, format characters; the common ones, not the whole Unicode table) as `\x`,
/// `\u` or `\U` escapes.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in s.chars() {
        let code = c as u32;
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            _ if code < 0x20 || code == 0x7f || !printable(code) => {
                let _ = match code {
                    0..=0xff => write!(out, "\\x{code:02x}"),
                    0x100..=0xffff => write!(out, "\\u{code:04x}"),
                    _ => write!(out, "\\U{code:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Whether Python's `str.isprintable` holds for a character beyond ASCII's controls: not a
/// separator other than the space, nor a control, format, surrogate or private-use character
/// (the ranges clients' text meets; unassigned code points are taken as printable).
fn printable(code: u32) -> bool {
    !matches!(
        code,
        0x80..=0xa0
            | 0xad
            | 0x600..=0x605
            | 0x61c
            | 0x6dd
            | 0x70f
            | 0x1680
            | 0x180e
            | 0x2000..=0x200f
            | 0x2028..=0x202f
            | 0x205f..=0x2064
            | 0x2066..=0x206f
            | 0x3000
            | 0xd800..=0xf8ff
            | 0xfeff
            | 0xfff9..=0xfffb
            | 0xe0001
            | 0xe0020..=0xe007f
            | 0xf0000..=0x10ffff
    )
}

/// The shortest digits that read back as finite `x`, its sign, and where the decimal point
/// falls, counted from the first digit (`1.5` is "15" at 1, `0.001` "1" at -2). Where two such
/// strings are equally close to `x`, Python takes the one ending in an even digit and Rust's
/// `{:e}` the upper one (a float32 logprob such as -11.4810943603515625 is "...562" in Python,
/// "...563" in Rust's form), so `x` is rounded exactly to the shortest form's number of digits,
/// which Rust does ties-to-even: that string reads back as `x` too, being at least as close.
fn shortest(x: f64) -> (&'static str, String, i32) {
    let rough = format!("{x:e}");
    let (mantissa, _) = rough
        .split_once('e')
        .expect("{:e} always writes an exponent");
    let count = mantissa.chars().filter(char::is_ascii_digit).count();
    let exact = format!("{:.*e}", count.saturating_sub(1), x);
    let (mantissa, exponent) = exact.split_once('e').expect("an exponent");
    let exponent: i32 = exponent.parse().expect("an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    (sign, mantissa.replace('.', ""), exponent + 1)
}

/// `digits` with the decimal point at `point`, in positional notation, with a `.0` where
/// nothing follows the point.
fn positional(digits: &str, point: i32) -> String {
    let n = digits.len() as i32;
    if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point >= n {
        format!("{digits}{}.0", "0".repeat((point - n) as usize))
    } else {
        format!(
            "{}.{}",
            &digits[..point as usize],
            &digits[point as usize..]
        )
    }
}

/// `digits` as `d.ddd` and the exponent of its first digit.
fn mantissa(digits: &str, point: i32) -> (String, i32) {
    let first = if digits.len() > 1 {
        format!("{}.{}", &digits[..1], &digits[1..])
    } else {
        digits.to_string()
    };
    (first, point - 1)
}

/// `repr(x)` of a Python float, as `json.dumps` writes it: positional while the decimal point
/// falls within 16 digits of the first and fewer than 4 zeros before it (`0.0001`, `1e-05`,
/// `1000000000000000.0`, `1e+16`), the exponent signed and of two digits at least.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let (sign, digits, point) = shortest(x);
    if point <= -4 || point > 16 {
        let (first, exponent) = mantissa(&digits, point);
        let mark = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{first}e{mark}{:02}", exponent.abs());
    }
    format!("{sign}{}", positional(&digits, point))
}

/// A float as msgspec writes it, which is serde_json's (ryu's) spelling: positional from
/// `0.00001` (then `1e-6`) up to 16 digits (`1e16`), ties to the even digit; NaN and infinities
/// are `null`. `tests/fixtures/metrics/values.txt` holds both to msgspec's output.
pub fn float_msgspec(x: f64) -> String {
    if !x.is_finite() {
        return "null".into();
    }
    serde_json::to_string(&x).expect("a finite double")
}

struct Reader<'a> {
    text: &'a [u8],
    at: usize,
    depth: usize,
}

impl Reader<'_> {
    /// JSON's whitespace, the only kind Python's parser skips.
    fn space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.text.get(self.at) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &str, value: Json) -> Option<Json> {
        if self.text[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            Some(value)
        } else {
            None
        }
    }

    fn value(&mut self) -> Option<Json> {
        match *self.text.get(self.at)? {
            b'"' => self.string().map(Json::Str),
            b'{' => self.nested(Self::object),
            b'[' => self.nested(Self::array),
            b't' => self.literal("true", Json::Bool(true)),
            b'f' => self.literal("false", Json::Bool(false)),
            b'n' => self.literal("null", Json::Null),
            b'N' => self.literal("NaN", Json::Float(f64::NAN)),
            b'I' => self.literal("Infinity", Json::Float(f64::INFINITY)),
            b'-' if self.text[self.at..].starts_with(b"-Infinity") => {
                self.literal("-Infinity", Json::Float(f64::NEG_INFINITY))
            }
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn nested(&mut self, read: fn(&mut Self) -> Option<Json>) -> Option<Json> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        let value = read(self);
        self.depth -= 1;
        value
    }

    fn digits(&mut self) -> usize {
        let start = self.at;
        while self.text.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        self.at - start
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, Python's number: an integer without a
    /// fraction or exponent, a float otherwise (each optional part only taken when whole).
    fn number(&mut self) -> Option<Json> {
        let start = self.at;
        if self.text[self.at] == b'-' {
            self.at += 1;
        }
        match self.text.get(self.at) {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return None,
        }
        let integer_end = self.at;
        let mut float = false;
        if self.text.get(self.at) == Some(&b'.')
            && self.text.get(self.at + 1).is_some_and(u8::is_ascii_digit)
        {
            self.at += 1;
            self.digits();
            float = true;
        }
        if let Some(b'e' | b'E') = self.text.get(self.at) {
            let mark = self.at;
            self.at += 1;
            if let Some(b'+' | b'-') = self.text.get(self.at) {
                self.at += 1;
            }
            if self.digits() == 0 {
                self.at = mark; // not an exponent: what follows is left to the caller
            } else {
                float = true;
            }
        }
        let text = std::str::from_utf8(&self.text[start..self.at]).ok()?;
        if float {
            return text.parse::<f64>().ok().map(Json::Float);
        }
        let digits = &self.text[start..integer_end];
        let count = digits.iter().filter(|b| b.is_ascii_digit()).count();
        if count > MAX_INT_DIGITS {
            return None;
        }
        Some(Json::Int(if text == "-0" {
            "0".into()
        } else {
            text.into()
        }))
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.text.get(self.at..self.at + 4)?;
        let text = std::str::from_utf8(digits).ok()?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.at += 4;
        u32::from_str_radix(text, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        self.at += 1; // the opening quote
        let mut out = String::new();
        loop {
            // Copy the run up to the next quote, backslash or control character at once.
            let start = self.at;
            while let Some(&b) = self.text.get(self.at) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.at += 1;
            }
            out.push_str(std::str::from_utf8(&self.text[start..self.at]).ok()?);
            match *self.text.get(self.at)? {
                b'"' => {
                    self.at += 1;
                    return Some(out);
                }
                b'\\' => {
                    self.at += 1;
                    let escape = *self.text.get(self.at)?;
                    self.at += 1;
                    match escape {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let unit = self.hex4()?;
                            let code = if (0xd800..0xdc00).contains(&unit)
                                && self.text[self.at..].starts_with(b"\\u")
                            {
                                // A high surrogate followed by a low one is one character.
                                let mark = self.at;
                                self.at += 2;
                                match self.hex4() {
                                    Some(low) if (0xdc00..0xe000).contains(&low) => {
                                        0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00)
                                    }
                                    _ => {
                                        self.at = mark;
                                        unit
                                    }
                                }
                            } else {
                                unit
                            };
                            out.push(char::from_u32(code)?); // a lone surrogate: refused
                        }
                        _ => return None,
                    }
                }
                _ => return None, // a control character: Python's strict parser refuses it
            }
        }
    }

    fn array(&mut self) -> Option<Json> {
        self.at += 1;
        let mut items = Vec::new();
        self.space();
        if self.text.get(self.at) == Some(&b']') {
            self.at += 1;
            return Some(Json::Array(items));
        }
        loop {
            self.space();
            items.push(self.value()?);
            self.space();
            match *self.text.get(self.at)? {
                b',' => self.at += 1,
                b']' => {
                    self.at += 1;
                    return Some(Json::Array(items));
                }
                _ => return None,
            }
        }
    }

    fn object(&mut self) -> Option<Json> {
        self.at += 1;
        let mut fields: Vec<(String, Json)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        self.space();
        if self.text.get(self.at) == Some(&b'}') {
            self.at += 1;
            return Some(Json::Object(fields));
        }
        loop {
            self.space();
            if self.text.get(self.at) != Some(&b'"') {
                return None;
            }
            let key = self.string()?;
            self.space();
            if self.text.get(self.at) != Some(&b':') {
                return None;
            }
            self.at += 1;
            self.space();
            let value = self.value()?;
            // A repeated key keeps its first place and takes the last value, as a dict does.
            match index.get(&key) {
                Some(&i) => fields[i].1 = value,
                None => {
                    index.insert(key.clone(), fields.len());
                    fields.push((key, value));
                }
            }
            self.space();
            match *self.text.get(self.at)? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(Json::Object(fields));
                }
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{float_msgspec, float_repr, Json};

    fn round_trip(text: &str) -> Option<String> {
        Json::parse(text).map(|value| value.dumps())
    }

    #[test]
    fn floats_are_spelt_as_python_repr_spells_them() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123.456, "123.456"),
            (-0.0, "-0.0"),
            (1.5e300, "1.5e+300"),
            (-2.5e-7, "-2.5e-07"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(float_repr(x), want);
        }
        for (x, want) in [
            (1e-5, "0.00001"),
            (1.2345e-5, "0.000012345"),
            (1e-6, "1e-6"),
            (9.99e-6, "9.99e-6"),
            (1e16, "1e16"),
            (-1.2345e17, "-1.2345e17"),
            (1e15, "1000000000000000.0"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (f64::NAN, "null"),
        ] {
            assert_eq!(float_msgspec(x), want);
        }
        // A tie between two shortest forms goes to the even digit, as in Python: the float32
        // logprob -752425/65536 = -11.4810943603515625.
        let tie = -752_425.0 / 65_536.0;
        assert_eq!(float_repr(tie), "-11.481094360351562");
        assert_eq!(float_msgspec(tie), "-11.481094360351562");
    }

    #[test]
    fn objects_keep_their_order_and_numbers_their_spelling() {
        assert_eq!(
            round_trip(r#" {"b": 1, "a": [1.50, 1E2, -0, 10000000000000000000000000], "b": 2} "#)
                .as_deref(),
            Some(r#"{"b": 2, "a": [1.5, 100.0, 0, 10000000000000000000000000]}"#)
        );
        assert_eq!(
            round_trip(r#"["\u00e9\ud83d\ude00", "\n\u0001", NaN, -Infinity, 1e400]"#).as_deref(),
            Some("[\"é😀\", \"\\n\\u0001\", NaN, -Infinity, Infinity]")
        );
    }

    #[test]
    fn ascii_dumps_and_repr_are_pythons() {
        let value = Json::parse(r#"{"s": "\u00e9\ud83d\ude00\u007f\n"}"#).unwrap();
        assert_eq!(
            value.dumps_ascii(),
            r#"{"s": "\u00e9\ud83d\ude00\u007f\n"}"#
        );
        let text = r#"[null, true, 1, 1e-05, "it's", "a\"b'c", {"k": "\u00a0é\u2028"},
                       "tab\there", "\u0000"]"#;
        assert_eq!(
            Json::parse(text).unwrap().repr(),
            r#"[None, True, 1, 1e-05, "it's", 'a"b\'c', {'k': '\xa0é\u2028'}, 'tab\there', '\x00']"#
        );
    }

    #[test]
    fn what_python_refuses_is_refused() {
        for bad in [
            "01",
            "1.",
            "-",
            "[1,]",
            "{\"a\" 1}",
            "\"\u{1}\"",
            "\"\\x\"",
            "{1: 2}",
            "1 2",
            "",
            "\"\\ud800\"",
            "tru",
            ".5",
            "\u{feff}1",
        ] {
            assert_eq!(Json::parse(bad), None, "{bad:?}");
        }
        assert!(Json::parse(&"1".repeat(4300)).is_some());
        assert!(Json::parse(&"1".repeat(4301)).is_none());
    }
}
