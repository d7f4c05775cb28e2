//! `/v1/events`: engine notifications as server-sent events, resumable from a ring, as the Python
//! API servers serve them (`rankcast/api_server/events.py` states the contract): ids
//! `<engine>:<incarnation>:<engine_seq>`, `type`/`key` filters, `Last-Event-ID` replay from a
//! bounded ring or a `replay_gap` notice, an `overflow` notice for a reader too slow to keep up.
//! Every API server keeps the same ring (the engine sends each the same stream in the same
//! order), so a client may resume on any sibling, Python or Rust.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use hyper::body::Bytes;
use rankcast_client::wire::notifications::is_known_type;
use rankcast_client::wire::{Raw, Value};
use serde_json::json;
use tokio::sync::mpsc;

const RING_SIZE: usize = 4096;
const SUBSCRIBER_QUEUE: usize = 10_000;

#[derive(Clone)]
pub struct Event {
    engine: i64,
    incarnation: i64,
    seq: i64,
    kind: String,
    key: String,
    data: String,
}

impl Event {
    fn id(&self) -> String {
        format!("{}:{}:{}", self.engine, self.incarnation, self.seq)
    }
    fn frame(&self) -> Bytes {
        Bytes::from(format!("id: {}\ndata: {}\n\n", self.id(), self.data))
    }
}

pub struct Filter {
    types: Vec<String>,
    keys: Vec<String>,
}

impl Filter {
    /// From the query string: `type=a,b&key=c` (either may be absent).
    pub fn parse(query: Option<&str>) -> Filter {
        let mut filter = Filter {
            types: Vec::new(),
            keys: Vec::new(),
        };
        for pair in query.unwrap_or("").split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let values = percent_decode(value);
            let values = values.split(',').map(str::trim).filter(|v| !v.is_empty());
            match name {
                "type" => filter.types.extend(values.map(str::to_string)),
                "key" => filter.keys.extend(values.map(str::to_string)),
                _ => {}
            }
        }
        filter
    }
    fn matches(&self, event: &Event) -> bool {
        (self.types.is_empty() || self.types.contains(&event.kind))
            && (self.keys.is_empty() || self.keys.contains(&event.key))
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A notification as JSON in its wire order, defaults left out (as msgspec writes it).
fn to_json(value: &Value) -> String {
    match value {
        Value::Nil => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Int(v) => v.to_string(),
        Value::Float(v) => serde_json::to_string(v).unwrap_or_else(|_| "null".into()),
        Value::Str(s) => serde_json::to_string(s).expect("a string"),
        Value::Bin(b) => serde_json::to_string(&String::from_utf8_lossy(b)).expect("a string"),
        Value::Array(items) => {
            format!(
                "[{}]",
                items.iter().map(to_json).collect::<Vec<_>>().join(",")
            )
        }
        Value::Map(items) => {
            let fields: Vec<String> = items
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        Value::Str(s) => s.clone(),
                        other => to_json(other),
                    };
                    format!(
                        "{}:{}",
                        serde_json::to_string(&key).expect("a key"),
                        to_json(v)
                    )
                })
                .collect();
            format!("{{{}}}", fields.join(","))
        }
    }
}

fn control_frame(name: &str, body: serde_json::Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {body}\n\n"))
}

/// One subscriber's end: its queue, and whether it was dropped for reading too slowly (its
/// stream then ends with an `overflow` notice once the queue is drained).
struct Subscriber {
    queue: mpsc::Sender<Event>,
    overflowed: Arc<AtomicBool>,
}

/// What a stream reads from.
pub struct Live {
    queue: mpsc::Receiver<Event>,
    overflowed: Arc<AtomicBool>,
}

#[derive(Default)]
struct Hub {
    ring: VecDeque<Event>,
    subscribers: Vec<Subscriber>,
    last_seq: Vec<(i64, i64)>,
    incarnation: Vec<(i64, i64)>,
}

fn lookup(pairs: &[(i64, i64)], engine: i64) -> Option<i64> {
    pairs.iter().find(|(e, _)| *e == engine).map(|(_, v)| *v)
}

fn store(pairs: &mut Vec<(i64, i64)>, engine: i64, value: i64) {
    match pairs.iter_mut().find(|(e, _)| *e == engine) {
        Some(pair) => pair.1 = value,
        None => pairs.push((engine, value)),
    }
}

pub struct EventHub {
    hub: Mutex<Hub>,
}

impl Default for EventHub {
    fn default() -> Self {
        EventHub {
            hub: Mutex::new(Hub::default()),
        }
    }
}

impl EventHub {
    pub fn apply_snapshot(&self, engine: i64, engine_seq: i64, incarnation: i64) {
        let mut hub = self.hub.lock().expect("events lock");
        store(&mut hub.last_seq, engine, engine_seq);
        store(&mut hub.incarnation, engine, incarnation);
    }

    /// The incarnation of the engine core now connected (0 before any handshake).
    pub fn incarnation(&self, engine: i64) -> i64 {
        let hub = self.hub.lock().expect("events lock");
        lookup(&hub.incarnation, engine).unwrap_or(0)
    }

    /// The notifications of one message from the engine, in order. Types this server does not
    /// know are counted by the metrics but kept out of the ring, as the Python servers do.
    pub fn consume(&self, raws: &[Raw]) {
        let mut hub = self.hub.lock().expect("events lock");
        for raw in raws {
            let Ok(value) = raw.decode_as::<Value>() else {
                continue;
            };
            let text = |name: &str| value.get(name).and_then(Value::as_str).unwrap_or("");
            let number = |name: &str| {
                value
                    .get(name)
                    .and_then(Value::as_int)
                    .map_or(-1, |v| v as i64)
            };
            let kind = text("type").to_string();
            if !is_known_type(&kind) {
                continue;
            }
            let key = if kind == "custom" {
                text("key").to_string()
            } else {
                String::new()
            };
            let (engine, seq) = (number("engine_index"), number("engine_seq"));
            let incarnation = lookup(&hub.incarnation, engine).unwrap_or(0);
            let event = Event {
                engine,
                incarnation,
                seq,
                kind,
                key,
                data: to_json(&value),
            };
            if hub.ring.len() == RING_SIZE {
                hub.ring.pop_front();
            }
            hub.ring.push_back(event.clone());
            store(&mut hub.last_seq, engine, seq);
            hub.subscribers.retain(
                |subscriber| match subscriber.queue.try_send(event.clone()) {
                    Ok(()) => true,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        // Too slow: dropped (it never holds the server's memory), and told so.
                        subscriber.overflowed.store(true, Ordering::SeqCst);
                        false
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                },
            );
        }
    }

    /// End every stream (the server is stopping).
    pub fn close(&self) {
        self.hub.lock().expect("events lock").subscribers.clear();
    }

    /// Subscribe and take what a resuming client missed, in one step under the lock, so no
    /// event is both replayed and delivered live, and none falls between the two.
    pub fn subscribe(
        &self,
        last_event_id: Option<&str>,
    ) -> Result<(Live, Vec<Event>, Option<Bytes>), String> {
        let parsed = last_event_id.map(parse_event_id).transpose()?;
        let mut hub = self.hub.lock().expect("events lock");
        let (queue, receiver) = mpsc::channel(SUBSCRIBER_QUEUE);
        let overflowed = Arc::new(AtomicBool::new(false));
        hub.subscribers.push(Subscriber {
            queue,
            overflowed: overflowed.clone(),
        });
        let rx = Live {
            queue: receiver,
            overflowed,
        };
        let Some((engine, incarnation, seq)) = parsed else {
            return Ok((rx, Vec::new(), None));
        };
        let last_event_id = last_event_id.unwrap_or_default();
        let ring: Vec<Event> = hub.ring.iter().cloned().collect();
        let current = lookup(&hub.incarnation, engine).unwrap_or(0);
        if incarnation != current {
            let after = ring
                .iter()
                .position(|e| (e.engine, e.incarnation, e.seq) == (engine, incarnation, seq))
                .map_or(0, |i| i + 1);
            let notice = control_frame(
                "replay_gap",
                json!({
                    "last_event_id": last_event_id,
                    "oldest_event_id": ring.get(after).map(Event::id),
                    "message": format!(
                        "engine {engine} restarted (incarnation {incarnation} -> {current}); \
                         events its old incarnation had not sent are lost"
                    ),
                }),
            );
            return Ok((rx, ring[after..].to_vec(), Some(notice)));
        }
        if let Some(i) = ring
            .iter()
            .position(|e| (e.engine, e.incarnation, e.seq) == (engine, incarnation, seq))
        {
            return Ok((rx, ring[i + 1..].to_vec(), None));
        }
        let own: Vec<usize> = (0..ring.len())
            .filter(|&i| ring[i].engine == engine && ring[i].incarnation == incarnation)
            .collect();
        if let Some(&first) = own.first() {
            if ring[first].seq == seq + 1 {
                return Ok((rx, ring[first..].to_vec(), None));
            }
        }
        if own.is_empty() && seq >= lookup(&hub.last_seq, engine).unwrap_or(-1) {
            return Ok((rx, Vec::new(), None));
        }
        let notice = control_frame(
            "replay_gap",
            json!({
                "last_event_id": last_event_id,
                "oldest_event_id": ring.first().map(Event::id),
                "message": "events after this id are no longer held; replaying what is",
            }),
        );
        Ok((rx, ring, Some(notice)))
    }
}

/// `engine:incarnation:seq` (or the older `engine:seq`, incarnation 0).
pub fn parse_event_id(value: &str) -> Result<(i64, i64, i64), String> {
    let bad = || format!("Last-Event-ID {value:?} is not of the form <engine>:<incarnation>:<seq>");
    let numbers: Vec<i64> = value
        .split(':')
        .map(|part| part.trim().parse::<i64>())
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    match numbers[..] {
        [engine, seq] => Ok((engine, 0, seq)),
        [engine, incarnation, seq] => Ok((engine, incarnation, seq)),
        _ => Err(bad()),
    }
}

/// The stream for one subscriber: the preamble, a gap notice, the replay, then live events
/// with a keep-alive comment every 15 s.
pub async fn stream(
    mut sender: hyper::body::Sender,
    filter: Filter,
    replay: Vec<Event>,
    notice: Option<Bytes>,
    mut live: Live,
) {
    let mut first = vec![Bytes::from_static(b": rankcast event stream\n\n")];
    first.extend(notice);
    first.extend(
        replay
            .iter()
            .filter(|e| filter.matches(e))
            .map(Event::frame),
    );
    for frame in first {
        if sender.send_data(frame).await.is_err() {
            return;
        }
    }
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(15), live.queue.recv());
        let frame = match next.await {
            Err(_) => Bytes::from_static(b": keepalive\n\n"),
            Ok(None) if live.overflowed.load(Ordering::SeqCst) => {
                let body =
                    json!({"message": "reader too slow; reconnect with Last-Event-ID to resume"});
                let _ = sender.send_data(control_frame("overflow", body)).await;
                return;
            }
            Ok(None) => return, // the server is stopping
            Ok(Some(event)) if filter.matches(&event) => event.frame(),
            Ok(Some(_)) => continue,
        };
        if sender.send_data(frame).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(fields: Vec<(&str, Value)>) -> Raw {
        let map = fields
            .into_iter()
            .map(|(k, v)| (Value::Str(k.into()), v))
            .collect();
        let mut bytes = Vec::new();
        rankcast_client::wire::Wire::encode(&Value::Map(map), &mut bytes);
        Raw(bytes)
    }

    #[test]
    fn known_events_enter_the_ring_as_json_in_wire_order_and_unknown_ones_do_not() {
        let hub = EventHub::default();
        hub.apply_snapshot(0, 4, 2);
        hub.consume(&[
            raw(vec![
                ("type", Value::Str("gpu_thermal".into())),
                ("engine_seq", Value::Int(5)),
            ]),
            raw(vec![
                ("type", Value::Str("custom".into())),
                ("key", Value::Str("k".into())),
                ("engine_seq", Value::Int(6)),
                ("engine_index", Value::Int(0)),
            ]),
        ]);
        let ring = &hub.hub.lock().unwrap().ring;
        assert_eq!(
            ring.len(),
            1,
            "an unknown type is not an event of the stream"
        );
        assert_eq!(ring[0].id(), "0:2:6");
        assert_eq!(
            (ring[0].kind.as_str(), ring[0].key.as_str()),
            ("custom", "k")
        );
        assert_eq!(
            ring[0].data,
            r#"{"type":"custom","key":"k","engine_seq":6,"engine_index":0}"#
        );
    }
}
