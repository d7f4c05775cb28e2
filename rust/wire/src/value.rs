//! A msgpack value of any type: what Python declares as `Any` (utility arguments and results,
//! custom notification payloads, a JSON schema given as an object).

use rmp::Marker;

use crate::codec::{
    error, read_int_marker, read_len, read_marker, take, write_array_len, write_map_len, write_nil,
    write_str, Result, Wire, WireError,
};

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    /// Every integer msgpack can carry (u64 above i64's range included).
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    /// Keys in wire order.
    Map(Vec<(Value, Value)>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }
    /// The value under `key` of a map with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

impl Wire for Value {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Value::Nil => write_nil(out),
            Value::Bool(b) => b.encode(out),
            Value::Int(v) => {
                if *v >= 0 {
                    rmp::encode::write_uint(out, *v as u64).expect("writing to a Vec");
                } else {
                    rmp::encode::write_sint(out, *v as i64).expect("writing to a Vec");
                }
            }
            Value::Float(v) => v.encode(out),
            Value::Str(s) => write_str(out, s),
            Value::Bin(b) => rmp::encode::write_bin(out, b).expect("writing to a Vec"),
            Value::Array(items) => {
                write_array_len(out, items.len());
                for item in items {
                    item.encode(out);
                }
            }
            Value::Map(items) => {
                write_map_len(out, items.len());
                for (k, v) in items {
                    k.encode(out);
                    v.encode(out);
                }
            }
        }
    }

    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let marker = read_marker(rd)?;
        if let Some(v) = read_int_marker(rd, marker)? {
            return Ok(Value::Int(v));
        }
        use rmp::decode::RmpRead;
        let early = |_| WireError("message ends early".into());
        Ok(match marker {
            Marker::Null => Value::Nil,
            Marker::True => Value::Bool(true),
            Marker::False => Value::Bool(false),
            Marker::F32 => Value::Float(rd.read_data_f32().map_err(early)? as f64),
            Marker::F64 => Value::Float(rd.read_data_f64().map_err(early)?),
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let n = read_len(rd, marker)?.unwrap_or(0);
                let bytes = take(rd, n)?;
                Value::Str(
                    String::from_utf8(bytes.to_vec())
                        .map_err(|_| WireError("a string is not UTF-8".into()))?,
                )
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = read_len(rd, marker)?.unwrap_or(0);
                Value::Bin(take(rd, n)?.to_vec())
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = read_len(rd, marker)?.unwrap_or(0);
                Value::Array((0..n).map(|_| Value::decode(rd)).collect::<Result<_>>()?)
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = read_len(rd, marker)?.unwrap_or(0);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = Value::decode(rd)?;
                    items.push((k, Value::decode(rd)?));
                }
                Value::Map(items)
            }
            other => return error(format!("unsupported msgpack marker {other:?}")),
        })
    }
}
