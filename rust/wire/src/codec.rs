//! How one Rust value becomes msgpack bytes and back, the way msgspec does it on the Python side.
//!
//! Byte-for-byte agreement with msgspec is the point: integers take their smallest form
//! (non-negative ones the unsigned family), every float is a float64, strings and containers
//! take their smallest length prefix. rmp writes and reads the markers; this module only decides
//! which ones, and reads a value of a type a struct field declares.

use rmp::decode::RmpRead;
use rmp::Marker;

/// A message that could not be read as the declared type, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WireError {}

pub type Result<T> = std::result::Result<T, WireError>;

pub fn error<T>(message: impl Into<String>) -> Result<T> {
    Err(WireError(message.into()))
}

/// Something with one msgpack form. `decode` reads exactly one value from the front of `rd`.
pub trait Wire: Sized {
    fn encode(&self, out: &mut Vec<u8>);
    fn decode(rd: &mut &[u8]) -> Result<Self>;
}

/// Encode one value into a fresh buffer.
pub fn to_bytes<T: Wire>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    value.encode(&mut out);
    out
}

/// Decode one value that must fill `bytes` exactly.
pub fn from_bytes<T: Wire>(bytes: &[u8]) -> Result<T> {
    let mut rd = bytes;
    let value = T::decode(&mut rd)?;
    if !rd.is_empty() {
        return error(format!("{} bytes left after the message", rd.len()));
    }
    Ok(value)
}

// ---- writing: Vec<u8> never fails, so the results are unwrapped once here ----

pub fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        rmp::encode::write_uint(out, v as u64).expect("writing to a Vec");
    } else {
        rmp::encode::write_sint(out, v).expect("writing to a Vec");
    }
}

pub fn write_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).expect("writing to a Vec");
}

pub fn write_array_len(out: &mut Vec<u8>, n: usize) {
    rmp::encode::write_array_len(out, n as u32).expect("writing to a Vec");
}

pub fn write_map_len(out: &mut Vec<u8>, n: usize) {
    rmp::encode::write_map_len(out, n as u32).expect("writing to a Vec");
}

pub fn write_nil(out: &mut Vec<u8>) {
    rmp::encode::write_nil(out).expect("writing to a Vec");
}

// ---- reading ----

pub fn read_marker(rd: &mut &[u8]) -> Result<Marker> {
    rmp::decode::read_marker(rd).map_err(|_| WireError("message ends early".into()))
}

fn data<T, E>(r: std::result::Result<T, E>) -> Result<T> {
    r.map_err(|_| WireError("message ends early".into()))
}

/// The next value is nil (without consuming it).
pub fn peek_nil(rd: &[u8]) -> bool {
    rd.first() == Some(&0xc0)
}

pub fn read_int_marker(rd: &mut &[u8], marker: Marker) -> Result<Option<i128>> {
    Ok(Some(match marker {
        Marker::FixPos(v) => v as i128,
        Marker::FixNeg(v) => v as i128,
        Marker::U8 => data(rd.read_data_u8())? as i128,
        Marker::U16 => data(rd.read_data_u16())? as i128,
        Marker::U32 => data(rd.read_data_u32())? as i128,
        Marker::U64 => data(rd.read_data_u64())? as i128,
        Marker::I8 => data(rd.read_data_i8())? as i128,
        Marker::I16 => data(rd.read_data_i16())? as i128,
        Marker::I32 => data(rd.read_data_i32())? as i128,
        Marker::I64 => data(rd.read_data_i64())? as i128,
        _ => return Ok(None),
    }))
}

pub fn read_len(rd: &mut &[u8], marker: Marker) -> Result<Option<usize>> {
    Ok(Some(match marker {
        Marker::FixStr(n) | Marker::FixArray(n) | Marker::FixMap(n) => n as usize,
        Marker::Str8 | Marker::Bin8 => data(rd.read_data_u8())? as usize,
        Marker::Str16 | Marker::Bin16 | Marker::Array16 | Marker::Map16 => {
            data(rd.read_data_u16())? as usize
        }
        Marker::Str32 | Marker::Bin32 | Marker::Array32 | Marker::Map32 => {
            data(rd.read_data_u32())? as usize
        }
        _ => return Ok(None),
    }))
}

pub fn take<'a>(rd: &mut &'a [u8], n: usize) -> Result<&'a [u8]> {
    if rd.len() < n {
        return error("message ends early");
    }
    let (head, tail) = rd.split_at(n);
    *rd = tail;
    Ok(head)
}

fn expected<T>(what: &str, marker: Marker) -> Result<T> {
    error(format!("expected {what}, found {marker:?}"))
}

pub fn read_array_len(rd: &mut &[u8]) -> Result<usize> {
    let marker = read_marker(rd)?;
    match marker {
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            Ok(read_len(rd, marker)?.unwrap_or(0))
        }
        _ => expected("an array", marker),
    }
}

pub fn read_map_len(rd: &mut &[u8]) -> Result<usize> {
    let marker = read_marker(rd)?;
    match marker {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Ok(read_len(rd, marker)?.unwrap_or(0)),
        _ => expected("a map", marker),
    }
}

pub fn read_str(rd: &mut &[u8]) -> Result<String> {
    let marker = read_marker(rd)?;
    match marker {
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
            let n = read_len(rd, marker)?.unwrap_or(0);
            let bytes = take(rd, n)?;
            String::from_utf8(bytes.to_vec()).map_err(|_| WireError("a string is not UTF-8".into()))
        }
        _ => expected("a string", marker),
    }
}

/// Skip one value of any type (a field this side does not know), refusing what `Value` would
/// refuse (a string that is not UTF-8, an extension type), without building it.
pub fn skip(rd: &mut &[u8]) -> Result<()> {
    let marker = read_marker(rd)?;
    if read_int_marker(rd, marker)?.is_some() {
        return Ok(());
    }
    match marker {
        Marker::Null | Marker::True | Marker::False => Ok(()),
        Marker::F32 => take(rd, 4).map(|_| ()),
        Marker::F64 => take(rd, 8).map(|_| ()),
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
            let n = read_len(rd, marker)?.unwrap_or(0);
            std::str::from_utf8(take(rd, n)?)
                .map(|_| ())
                .map_err(|_| WireError("a string is not UTF-8".into()))
        }
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
            let n = read_len(rd, marker)?.unwrap_or(0);
            take(rd, n).map(|_| ())
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = read_len(rd, marker)?.unwrap_or(0);
            (0..n).try_for_each(|_| skip(rd))
        }
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let n = read_len(rd, marker)?.unwrap_or(0);
            (0..2 * n).try_for_each(|_| skip(rd))
        }
        other => error(format!("unsupported msgpack marker {other:?}")),
    }
}

// ---- the types struct fields are made of ----

impl Wire for i64 {
    fn encode(&self, out: &mut Vec<u8>) {
        write_int(out, *self);
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let marker = read_marker(rd)?;
        match read_int_marker(rd, marker)? {
            Some(v) => i64::try_from(v).map_err(|_| WireError(format!("{v} is out of range"))),
            None => expected("an integer", marker),
        }
    }
}

impl Wire for u64 {
    fn encode(&self, out: &mut Vec<u8>) {
        rmp::encode::write_uint(out, *self).expect("writing to a Vec");
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let marker = read_marker(rd)?;
        match read_int_marker(rd, marker)? {
            Some(v) => u64::try_from(v).map_err(|_| WireError(format!("{v} is out of range"))),
            None => expected("an integer", marker),
        }
    }
}

impl Wire for f64 {
    fn encode(&self, out: &mut Vec<u8>) {
        rmp::encode::write_f64(out, *self).expect("writing to a Vec");
    }
    /// Integers are accepted too, as msgspec accepts them for a float field.
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let marker = read_marker(rd)?;
        match marker {
            Marker::F64 => data(rd.read_data_f64()),
            Marker::F32 => Ok(data(rd.read_data_f32())? as f64),
            _ => match read_int_marker(rd, marker)? {
                Some(v) => Ok(v as f64),
                None => expected("a number", marker),
            },
        }
    }
}

impl Wire for bool {
    fn encode(&self, out: &mut Vec<u8>) {
        rmp::encode::write_bool(out, *self).expect("writing to a Vec");
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        match read_marker(rd)? {
            Marker::True => Ok(true),
            Marker::False => Ok(false),
            other => expected("a boolean", other),
        }
    }
}

impl Wire for String {
    fn encode(&self, out: &mut Vec<u8>) {
        write_str(out, self);
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        read_str(rd)
    }
}

impl<T: Wire> Wire for Option<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Some(v) => v.encode(out),
            None => write_nil(out),
        }
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        if peek_nil(rd) {
            *rd = &rd[1..];
            return Ok(None);
        }
        T::decode(rd).map(Some)
    }
}

impl<T: Wire> Wire for Vec<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        write_array_len(out, self.len());
        for item in self {
            item.encode(out);
        }
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let n = read_array_len(rd)?;
        (0..n).map(|_| T::decode(rd)).collect()
    }
}

impl<T: Wire> Wire for Box<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        (**self).encode(out);
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        T::decode(rd).map(Box::new)
    }
}

/// A `dict[str, T]`: string keys in the order they came (Python dicts keep insertion order, and
/// re-encoding must give the same bytes).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Dict<T>(pub Vec<(String, T)>);

impl<T> Dict<T> {
    pub fn new() -> Self {
        Dict(Vec::new())
    }
    pub fn get(&self, key: &str) -> Option<&T> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<T: Wire> Wire for Dict<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        write_map_len(out, self.0.len());
        for (k, v) in &self.0 {
            write_str(out, k);
            v.encode(out);
        }
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let n = read_map_len(rd)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let k = read_str(rd)?;
            items.push((k, T::decode(rd)?));
        }
        Ok(Dict(items))
    }
}

/// One encoded value kept as its bytes (msgspec's `Raw`): the engine forwards notifications it
/// has already encoded, and a frontend decodes each when it reads it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Raw(pub Vec<u8>);

impl Wire for Raw {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0);
    }
    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let start = *rd;
        skip(rd)?;
        Ok(Raw(start[..start.len() - rd.len()].to_vec()))
    }
}

impl Raw {
    pub fn of<T: Wire>(value: &T) -> Raw {
        Raw(to_bytes(value))
    }
    pub fn decode_as<T: Wire>(&self) -> Result<T> {
        from_bytes(&self.0)
    }
}

// ---- what the struct macros call ----

#[doc(hidden)]
pub fn fail<T>(message: impl Into<String>) -> Result<T> {
    error(message)
}

#[doc(hidden)]
pub fn missing<T>(name: &str, field: &str) -> Result<T> {
    error(format!(
        "{name}: required field {} is missing",
        crate::field_name_dyn(field)
    ))
}

#[doc(hidden)]
pub fn in_field<T>(result: Result<T>, name: &str, field: &str) -> Result<T> {
    result.map_err(|e| WireError(format!("{name}.{}: {e}", crate::field_name_dyn(field))))
}

#[doc(hidden)]
pub fn wrong_tag<T>(name: &str, wanted: &str, found: &str) -> Result<T> {
    error(format!(
        "{name}: tag {found:?} where {wanted:?} was expected"
    ))
}

#[doc(hidden)]
pub fn expect_tag(rd: &mut &[u8], remaining: &mut usize, wanted: &str) -> Result<()> {
    if *remaining == 0 {
        return error(format!("an empty array where tag {wanted:?} was expected"));
    }
    *remaining -= 1;
    let found = read_str(rd)?;
    if found != wanted {
        return error(format!("tag {found:?} where {wanted:?} was expected"));
    }
    Ok(())
}
