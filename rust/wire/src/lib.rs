//! rankcast's wire, in Rust: every message the engine core and its API servers (and its ranks)
//! exchange, with the same bytes as the Python side (`rankcast/protocol.py`,
//! `rankcast/channel/events.py`, `rankcast/sampling_params.py`, `rankcast/structured_outputs.py`).
//!
//! The rules, as `docs/architecture.md` states them:
//! - Array-like structs are msgpack arrays whose field order is the contract; tagged ones start
//!   with their tag. A peer appends fields at the end only: a decoder reads the fields it knows,
//!   gives missing trailing ones their defaults and skips extra trailing ones.
//! - Map structs (sampling parameters, structured-output shapes, notifications) are msgpack maps
//!   that leave out every field equal to its default; notifications carry a `"type"` tag, and a
//!   frontend that meets a type it does not know keeps it as a plain value and counts it.
//! - `PROTOCOL_VERSION` is checked at the handshake; a peer of another version is refused with
//!   both versions named.
//!
//! Each struct also states its name, tag and field names (`Schema`), which the tests compare with
//! what the Python side declares, so a field changed on one side only fails `make test`.

pub mod codec;
pub mod notifications;
pub mod protocol;
pub mod sampling;
pub mod value;

pub use codec::{from_bytes, to_bytes, Dict, Raw, Result, Wire, WireError};
pub use value::Value;

/// A struct's place in the contract: what the Python side's schema lists for it.
pub trait Schema {
    const NAME: &'static str;
    /// "array" (array-like, every field always present) or "map" (defaults left out).
    const KIND: &'static str;
    const TAG: Option<&'static str>;
    /// Field names in wire order.
    const FIELDS: &'static [&'static str];

    /// The schema line: `<kind> <Name> tag=<tag or ->: <field> <field> ...`.
    fn schema_line() -> String {
        let fields: Vec<&str> = Self::FIELDS.iter().map(|f| field_name(f)).collect();
        format!(
            "{} {} tag={}: {}",
            Self::KIND,
            Self::NAME,
            Self::TAG.unwrap_or("-"),
            fields.join(" ")
        )
    }
}

/// A field's wire name: Rust spells a field named like a keyword `r#type`.
pub fn field_name(rust_name: &'static str) -> &'static str {
    rust_name.strip_prefix("r#").unwrap_or(rust_name)
}

#[doc(hidden)]
#[macro_export]
macro_rules! __tag {
    () => {
        None
    };
    ($tag:literal) => {
        Some($tag)
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __default_or_missing {
    ($name:ident, $field:ident) => {
        return $crate::codec::missing(stringify!($name), stringify!($field))
    };
    ($name:ident, $field:ident, $default:expr) => {
        $default
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __is_default {
    ($value:expr, $ty:ty) => {
        false
    };
    ($value:expr, $ty:ty, $default:expr) => {{
        let default: $ty = $default;
        $value == default
    }};
}

#[doc(hidden)]
#[macro_export]
macro_rules! __declare {
    ($kind:literal $(#[$meta:meta])* $name:ident $(tag $tag:literal)? {
        $( $(#[$fmeta:meta])* $field:ident : $ty:ty ),*
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl $crate::Schema for $name {
            const NAME: &'static str = stringify!($name);
            const KIND: &'static str = $kind;
            const TAG: Option<&'static str> = $crate::__tag!($($tag)?);
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
        }
    };
}

/// An array-like struct (optionally tagged): `array_struct! { Name tag "t" { field: Type = default, ... } }`.
/// Fields without a default are required; the rest default when a shorter (older) peer left
/// them out.
#[macro_export]
macro_rules! array_struct {
    ($(#[$meta:meta])* $name:ident $(tag $tag:literal)? {
        $( $(#[$fmeta:meta])* $field:ident : $ty:ty $(= $default:expr)? ),* $(,)?
    }) => {
        $crate::__declare! {
            "array" $(#[$meta])* $name $(tag $tag)? { $( $(#[$fmeta])* $field : $ty ),* }
        }

        impl $name {
            /// The fields that follow the array header (and the tag), `remaining` of them.
            #[allow(unused_mut)] // a struct without fields never counts down
            pub fn decode_fields(rd: &mut &[u8], mut remaining: usize) -> $crate::Result<Self> {
                $(
                    let $field: $ty = if remaining > 0 {
                        remaining -= 1;
                        $crate::codec::in_field(
                            <$ty as $crate::Wire>::decode(rd),
                            stringify!($name),
                            stringify!($field),
                        )?
                    } else {
                        $crate::__default_or_missing!($name, $field $(, $default)?)
                    };
                )*
                for _ in 0..remaining {
                    $crate::codec::skip(rd)?; // fields of a newer peer
                }
                Ok(Self { $($field),* })
            }
        }

        impl $crate::Wire for $name {
            fn encode(&self, out: &mut Vec<u8>) {
                let tag = <Self as $crate::Schema>::TAG;
                let fields = <Self as $crate::Schema>::FIELDS.len();
                $crate::codec::write_array_len(out, fields + usize::from(tag.is_some()));
                if let Some(tag) = tag {
                    $crate::codec::write_str(out, tag);
                }
                $( $crate::Wire::encode(&self.$field, out); )*
            }

            fn decode(rd: &mut &[u8]) -> $crate::Result<Self> {
                let mut remaining = $crate::codec::read_array_len(rd)?;
                if let Some(tag) = <Self as $crate::Schema>::TAG {
                    $crate::codec::expect_tag(rd, &mut remaining, tag)?;
                }
                Self::decode_fields(rd, remaining)
            }
        }
    };
}

/// A map struct that leaves out fields equal to their defaults (optionally tagged by a `"type"`
/// key, written first): `map_struct! { Name tag "t" { field: Type = default, ... } }`.
#[macro_export]
macro_rules! map_struct {
    ($(#[$meta:meta])* $name:ident $(tag $tag:literal)? {
        $( $(#[$fmeta:meta])* $field:ident : $ty:ty $(= $default:expr)? ),* $(,)?
    }) => {
        $crate::__declare! {
            "map" $(#[$meta])* $name $(tag $tag)? { $( $(#[$fmeta])* $field : $ty ),* }
        }

        impl $crate::Wire for $name {
            fn encode(&self, out: &mut Vec<u8>) {
                let tag = <Self as $crate::Schema>::TAG;
                let mut count = usize::from(tag.is_some());
                $( if !$crate::__is_default!(self.$field, $ty $(, $default)?) { count += 1; } )*
                $crate::codec::write_map_len(out, count);
                if let Some(tag) = tag {
                    $crate::codec::write_str(out, "type");
                    $crate::codec::write_str(out, tag);
                }
                $(
                    if !$crate::__is_default!(self.$field, $ty $(, $default)?) {
                        $crate::codec::write_str(out, $crate::field_name(stringify!($field)));
                        $crate::Wire::encode(&self.$field, out);
                    }
                )*
            }

            fn decode(rd: &mut &[u8]) -> $crate::Result<Self> {
                let entries = $crate::codec::read_map_len(rd)?;
                $( let mut $field: Option<$ty> = None; )*
                for _ in 0..entries {
                    let key = $crate::codec::read_str(rd)?;
                    $(
                        if key == $crate::field_name(stringify!($field)) {
                            $field = Some($crate::codec::in_field(
                                <$ty as $crate::Wire>::decode(rd),
                                stringify!($name),
                                stringify!($field),
                            )?);
                            continue;
                        }
                    )*
                    if key == "type" {
                        if let Some(tag) = <Self as $crate::Schema>::TAG {
                            let found = $crate::codec::read_str(rd)?;
                            if found != tag {
                                return $crate::codec::wrong_tag(stringify!($name), tag, &found);
                            }
                            continue;
                        }
                    }
                    $crate::codec::skip(rd)?; // a field of a newer peer
                }
                Ok(Self {
                    $(
                        $field: match $field {
                            Some(value) => value,
                            None => $crate::__default_or_missing!($name, $field $(, $default)?),
                        },
                    )*
                })
            }
        }
    };
}

/// A union of tagged array-like structs, told apart by the tag that starts the array.
#[macro_export]
macro_rules! array_union {
    ($(#[$meta:meta])* $name:ident { $( $variant:ident($ty:ty) ),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq)]
        #[allow(clippy::large_enum_variant)] // messages are built once and moved rarely
        pub enum $name {
            $( $variant($ty), )*
        }

        impl $crate::Wire for $name {
            fn encode(&self, out: &mut Vec<u8>) {
                match self {
                    $( $name::$variant(inner) => $crate::Wire::encode(inner, out), )*
                }
            }

            fn decode(rd: &mut &[u8]) -> $crate::Result<Self> {
                let length = $crate::codec::read_array_len(rd)?;
                if length == 0 {
                    return $crate::codec::fail(concat!(stringify!($name), ": an empty array has no tag"));
                }
                let tag = $crate::codec::read_str(rd)?;
                $(
                    if Some(tag.as_str()) == <$ty as $crate::Schema>::TAG {
                        return <$ty>::decode_fields(rd, length - 1).map($name::$variant);
                    }
                )*
                $crate::codec::fail(format!("{}: unknown tag {:?}", stringify!($name), tag))
            }
        }
    };
}

#[doc(hidden)]
pub fn field_name_dyn(rust_name: &str) -> &str {
    rust_name.strip_prefix("r#").unwrap_or(rust_name)
}

/// Every struct of the wire, one schema line each, in the order the Python side lists them
/// (`tests/fixtures/wire/schema.txt`: module by module, `rankcast/protocol.py`,
/// `rankcast/channel/events.py`, `rankcast/channel/snapshot.py`, then the sampling ones).
pub fn schema() -> Vec<String> {
    use notifications::*;
    use protocol::*;
    use sampling::*;
    vec![
        TokenLogprobs::schema_line(),
        ClientHello::schema_line(),
        EngineCoreRequest::schema_line(),
        AbortRequests::schema_line(),
        UtilityRequest::schema_line(),
        EngineCoreOutput::schema_line(),
        SchedulerStats::schema_line(),
        UtilityOutput::schema_line(),
        LoRAAdapterInfo::schema_line(),
        EngineCoreOutputs::schema_line(),
        EngineReady::schema_line(),
        ScheduledSequence::schema_line(),
        LoRAMove::schema_line(),
        SchedulerOutput::schema_line(),
        PromptLogprobs::schema_line(),
        ModelRunnerOutput::schema_line(),
        AdapterRead::schema_line(),
        StepReply::schema_line(),
        WorkerCall::schema_line(),
        WorkerReply::schema_line(),
        Ping::schema_line(),
        GetStats::schema_line(),
        Snapshot::schema_line(),
        CollectiveRPC::schema_line(),
        AddLoRA::schema_line(),
        RemoveLoRA::schema_line(),
        PinLoRA::schema_line(),
        ListLoRAs::schema_line(),
        ResetPrefixCache::schema_line(),
        CacheBudget::schema_line(),
        NumAvailableBlocks::schema_line(),
        CacheAllocated::schema_line(),
        InitializeCache::schema_line(),
        TakeNotifications::schema_line(),
        ApplyLoRAMoves::schema_line(),
        ExecuteModel::schema_line(),
        CustomNotification::schema_line(),
        NotificationsDropped::schema_line(),
        LoRAAdapterLoaded::schema_line(),
        LoRAAdapterActivated::schema_line(),
        LoRAAdapterEvicted::schema_line(),
        LoRAAdapterPinned::schema_line(),
        LoRAAdapterUnpinned::schema_line(),
        LoRAAdapterLoadFailed::schema_line(),
        KVBlocksStored::schema_line(),
        KVBlocksRemoved::schema_line(),
        KVCacheCleared::schema_line(),
        NotificationBatch::schema_line(),
        NotificationTotal::schema_line(),
        RankCount::schema_line(),
        RankWeightsLoaded::schema_line(),
        RankExpertTokens::schema_line(),
        NotificationLedgerState::schema_line(),
        RankTier::schema_line(),
        AdapterResidency::schema_line(),
        LoRAEventCount::schema_line(),
        LoRALoadTime::schema_line(),
        LoRAState::schema_line(),
        KVCacheBlock::schema_line(),
        KVCacheState::schema_line(),
        EngineStateSnapshot::schema_line(),
        SamplingParams::schema_line(),
        StructuredOutputs::schema_line(),
    ]
}
