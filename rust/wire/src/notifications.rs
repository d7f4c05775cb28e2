//! The engine notification channel's events (`rankcast/channel/events.py`): maps tagged by a
//! `"type"` key, defaults left out, each stamped with where it came from (`seq` per producer,
//! `engine_seq` by the engine core, the publishing rank's coordinates; -1 where not stamped).
//!
//! A frontend that meets a type it does not know keeps it as `Notification::Unknown` (it can
//! still read the tag, count it and skip it), so a newer producer never breaks an older frontend.

use crate::codec::{read_map_len, read_str, skip, Result};
use crate::{array_struct, map_struct, Dict, Schema, Value, Wire};

/// `map_struct!` with the stamp every notification carries after its own fields.
macro_rules! notification {
    ($(#[$meta:meta])* $name:ident tag $tag:literal { $($fields:tt)* }) => {
        map_struct! {
            $(#[$meta])*
            $name tag $tag {
                $($fields)*
                seq: i64 = 0,
                timestamp: f64 = 0.0,
                engine_seq: i64 = -1,
                engine_index: i64 = -1,
                dp_rank: i64 = -1,
                pp_rank: i64 = -1,
                tp_rank: i64 = -1,
                rank: i64 = -1,
            }
        }
    };
}

notification! {
    /// Any producer's event, named by a dotted `key`.
    CustomNotification tag "custom" {
        key: String,
        payload: Dict<Value> = Dict::new(),
    }
}

notification! {
    /// `count` events were lost before this one (a worker's buffer, or with rank -1 the engine's).
    NotificationsDropped tag "notifications_dropped" {
        count: i64,
    }
}

notification! {
    LoRAAdapterLoaded tag "lora_adapter_loaded" {
        adapter_name: String,
        adapter_id: i64,
        tier: String,
        seconds: f64,
    }
}

notification! {
    LoRAAdapterActivated tag "lora_adapter_activated" {
        adapter_name: String,
        adapter_id: i64,
        tier: String,
        seconds: f64,
        slot: i64,
    }
}

notification! {
    /// `reason`: "lru", "capacity", "unload", ...
    LoRAAdapterEvicted tag "lora_adapter_evicted" {
        adapter_name: String,
        adapter_id: i64,
        tier: String,
        reason: String,
    }
}

notification! {
    LoRAAdapterPinned tag "lora_adapter_pinned" {
        adapter_name: String,
        adapter_id: i64,
        tier: String,
    }
}

notification! {
    LoRAAdapterUnpinned tag "lora_adapter_unpinned" {
        adapter_name: String,
        adapter_id: i64,
        tier: String,
    }
}

notification! {
    LoRAAdapterLoadFailed tag "lora_adapter_load_failed" {
        adapter_name: String,
        error: String,
        adapter_id: i64 = -1,
    }
}

notification! {
    /// Full blocks of one sequence cached, in order, after `parent_block_hash`.
    KVBlocksStored tag "kv_blocks_stored" {
        block_hashes: Vec<i64>,
        parent_block_hash: Option<i64>,
        token_ids: Vec<i64>,
        block_size: i64,
        lora_id: i64 = 0,
        lora_name: Option<String> = None,
        group_idx: i64 = 0,
    }
}

notification! {
    KVBlocksRemoved tag "kv_blocks_removed" {
        block_hashes: Vec<i64>,
        group_idx: i64 = 0,
    }
}

notification! {
    KVCacheCleared tag "kv_cache_cleared" {}
}

/// Any notification a frontend may receive.
#[derive(Debug, Clone, PartialEq)]
pub enum Notification {
    Custom(CustomNotification),
    Dropped(NotificationsDropped),
    LoRALoaded(LoRAAdapterLoaded),
    LoRAActivated(LoRAAdapterActivated),
    LoRAEvicted(LoRAAdapterEvicted),
    LoRAPinned(LoRAAdapterPinned),
    LoRAUnpinned(LoRAAdapterUnpinned),
    LoRALoadFailed(LoRAAdapterLoadFailed),
    KVStored(KVBlocksStored),
    KVRemoved(KVBlocksRemoved),
    KVCleared(KVCacheCleared),
    /// A type this build does not know, kept whole.
    Unknown(Value),
}

/// The `"type"` of the notification at the front of `rd`, without consuming it.
fn peek_type(mut rd: &[u8]) -> Result<Option<String>> {
    let entries = read_map_len(&mut rd)?;
    for _ in 0..entries {
        if read_str(&mut rd)? == "type" {
            return Ok(Some(read_str(&mut rd)?));
        }
        skip(&mut rd)?;
    }
    Ok(None)
}

/// The tags of every notification type this build knows.
const KNOWN_TYPES: [Option<&str>; 11] = [
    CustomNotification::TAG,
    NotificationsDropped::TAG,
    LoRAAdapterLoaded::TAG,
    LoRAAdapterActivated::TAG,
    LoRAAdapterEvicted::TAG,
    LoRAAdapterPinned::TAG,
    LoRAAdapterUnpinned::TAG,
    LoRAAdapterLoadFailed::TAG,
    KVBlocksStored::TAG,
    KVBlocksRemoved::TAG,
    KVCacheCleared::TAG,
];

/// Whether `tag` names a notification type this build knows (others decode as `Unknown`).
pub fn is_known_type(tag: &str) -> bool {
    KNOWN_TYPES.contains(&Some(tag))
}

impl Notification {
    /// When its producer published it (unix seconds); None for a type this build does not know.
    pub fn timestamp(&self) -> Option<f64> {
        Some(match self {
            Notification::Custom(n) => n.timestamp,
            Notification::Dropped(n) => n.timestamp,
            Notification::LoRALoaded(n) => n.timestamp,
            Notification::LoRAActivated(n) => n.timestamp,
            Notification::LoRAEvicted(n) => n.timestamp,
            Notification::LoRAPinned(n) => n.timestamp,
            Notification::LoRAUnpinned(n) => n.timestamp,
            Notification::LoRALoadFailed(n) => n.timestamp,
            Notification::KVStored(n) => n.timestamp,
            Notification::KVRemoved(n) => n.timestamp,
            Notification::KVCleared(n) => n.timestamp,
            Notification::Unknown(_) => return None,
        })
    }

    /// Its place in the engine's stream (`engine_seq`, -1 where not stamped); None for a type
    /// this build does not know.
    pub fn engine_seq(&self) -> Option<i64> {
        self.stamp().map(|(seq, _, _)| seq)
    }

    /// The engine core that gathered it (-1 where not stamped); None for an unknown type.
    pub fn engine_index(&self) -> Option<i64> {
        self.stamp().map(|(_, engine, _)| engine)
    }

    /// The rank that published it (-1: the engine core's own); None for an unknown type.
    pub fn rank(&self) -> Option<i64> {
        self.stamp().map(|(_, _, rank)| rank)
    }

    /// (engine_seq, engine_index, rank) of a known type.
    fn stamp(&self) -> Option<(i64, i64, i64)> {
        macro_rules! stamp {
            ($n:expr) => {
                Some(($n.engine_seq, $n.engine_index, $n.rank))
            };
        }
        match self {
            Notification::Custom(n) => stamp!(n),
            Notification::Dropped(n) => stamp!(n),
            Notification::LoRALoaded(n) => stamp!(n),
            Notification::LoRAActivated(n) => stamp!(n),
            Notification::LoRAEvicted(n) => stamp!(n),
            Notification::LoRAPinned(n) => stamp!(n),
            Notification::LoRAUnpinned(n) => stamp!(n),
            Notification::LoRALoadFailed(n) => stamp!(n),
            Notification::KVStored(n) => stamp!(n),
            Notification::KVRemoved(n) => stamp!(n),
            Notification::KVCleared(n) => stamp!(n),
            Notification::Unknown(_) => None,
        }
    }

    /// The wire tag ("custom", "lora_adapter_loaded", ...).
    pub fn type_name(&self) -> String {
        match self {
            Notification::Custom(_) => CustomNotification::TAG,
            Notification::Dropped(_) => NotificationsDropped::TAG,
            Notification::LoRALoaded(_) => LoRAAdapterLoaded::TAG,
            Notification::LoRAActivated(_) => LoRAAdapterActivated::TAG,
            Notification::LoRAEvicted(_) => LoRAAdapterEvicted::TAG,
            Notification::LoRAPinned(_) => LoRAAdapterPinned::TAG,
            Notification::LoRAUnpinned(_) => LoRAAdapterUnpinned::TAG,
            Notification::LoRALoadFailed(_) => LoRAAdapterLoadFailed::TAG,
            Notification::KVStored(_) => KVBlocksStored::TAG,
            Notification::KVRemoved(_) => KVBlocksRemoved::TAG,
            Notification::KVCleared(_) => KVCacheCleared::TAG,
            Notification::Unknown(value) => {
                return value
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            }
        }
        .unwrap_or_default()
        .to_string()
    }
}

impl Wire for Notification {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Notification::Custom(n) => n.encode(out),
            Notification::Dropped(n) => n.encode(out),
            Notification::LoRALoaded(n) => n.encode(out),
            Notification::LoRAActivated(n) => n.encode(out),
            Notification::LoRAEvicted(n) => n.encode(out),
            Notification::LoRAPinned(n) => n.encode(out),
            Notification::LoRAUnpinned(n) => n.encode(out),
            Notification::LoRALoadFailed(n) => n.encode(out),
            Notification::KVStored(n) => n.encode(out),
            Notification::KVRemoved(n) => n.encode(out),
            Notification::KVCleared(n) => n.encode(out),
            Notification::Unknown(value) => value.encode(out),
        }
    }

    fn decode(rd: &mut &[u8]) -> Result<Self> {
        let tag = peek_type(rd)?;
        Ok(match tag.as_deref() {
            Some("custom") => Notification::Custom(Wire::decode(rd)?),
            Some("notifications_dropped") => Notification::Dropped(Wire::decode(rd)?),
            Some("lora_adapter_loaded") => Notification::LoRALoaded(Wire::decode(rd)?),
            Some("lora_adapter_activated") => Notification::LoRAActivated(Wire::decode(rd)?),
            Some("lora_adapter_evicted") => Notification::LoRAEvicted(Wire::decode(rd)?),
            Some("lora_adapter_pinned") => Notification::LoRAPinned(Wire::decode(rd)?),
            Some("lora_adapter_unpinned") => Notification::LoRAUnpinned(Wire::decode(rd)?),
            Some("lora_adapter_load_failed") => Notification::LoRALoadFailed(Wire::decode(rd)?),
            Some("kv_blocks_stored") => Notification::KVStored(Wire::decode(rd)?),
            Some("kv_blocks_removed") => Notification::KVRemoved(Wire::decode(rd)?),
            Some("kv_cache_cleared") => Notification::KVCleared(Wire::decode(rd)?),
            _ => Notification::Unknown(Value::decode(rd)?),
        })
    }
}

crate::array_struct! {
    /// One frame of the ZMQ event stream: the events one flush sent, in order.
    NotificationBatch {
        timestamp: f64,
        engine_index: i64,
        notifications: Vec<crate::Raw>,
    }
}

// ---- the channel's section of the engine's catch-up snapshot ----

array_struct! {
    NotificationTotal {
        r#type: String,
        key: String,
        count: i64,
    }
}

array_struct! {
    RankCount {
        rank: i64,
        count: i64,
    }
}

array_struct! {
    RankWeightsLoaded {
        rank: i64,
        payload: Dict<Value>,
    }
}

array_struct! {
    /// The tokens one rank's MoE layer routed to each expert, in expert order, over every
    /// `rankcast.expert_load` event of the incarnation (protocol 16).
    RankExpertTokens {
        rank: i64,
        layer: i64,
        tokens: Vec<i64>,
    }
}

array_struct! {
    /// The notification ledger: totals by type and key, drops by rank, each rank's weight load,
    /// each rank's tokens per expert of each MoE layer (protocol 16).
    NotificationLedgerState {
        totals: Vec<NotificationTotal> = Vec::new(),
        dropped: Vec<RankCount> = Vec::new(),
        weights_loaded: Vec<RankWeightsLoaded> = Vec::new(),
        expert_tokens: Vec<RankExpertTokens> = Vec::new(),
    }
}
