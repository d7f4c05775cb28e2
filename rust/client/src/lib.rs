//! An engine-core client in Rust: the same ZMQ sockets and handshake as the Python API server's
//! (`rankcast/engine_client/mp_client.py`), so a Rust frontend is one more client of the engine core.
//!
//! Per client the engine core binds a PULL socket (its input) and a PUSH socket (its output).
//! The client connects a PUSH to the first and a PULL to the second, sends `ClientHello` with its
//! protocol version and client index, and waits for `EngineReady`: the engine's geometry and the
//! catch-up snapshot (the notification ledger, LoRA residency, the KV-cache index) that the
//! stream of `EngineCoreOutputs` continues after. An engine of another protocol version refuses
//! the hello naming both versions; this client also refuses an engine that answers with another
//! version than its own.

use std::time::{Duration, Instant};

pub use rankcast_wire as wire;
use rankcast_wire::protocol::{
    AbortRequests, ClientHello, EngineCoreInput, EngineCoreMessage, EngineCoreOutputs,
    EngineCoreRequest, EngineReady, UtilityOutput, UtilityRequest, PROTOCOL_VERSION,
};
use rankcast_wire::{from_bytes, to_bytes, Value, WireError};

/// Why talking to the engine core failed.
#[derive(Debug)]
pub enum ClientError {
    /// The engine refused the hello, or answered with another protocol version: both named.
    ProtocolMismatch(String),
    /// Nothing came within the deadline.
    Timeout(String),
    /// Bytes that do not decode as the declared message.
    Wire(WireError),
    Zmq(zmq::Error),
    /// A utility call failed on the engine: its message and machine-readable kind.
    Utility {
        message: String,
        kind: String,
    },
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::ProtocolMismatch(m) | ClientError::Timeout(m) => f.write_str(m),
            ClientError::Wire(e) => write!(f, "undecodable message from the engine core: {e}"),
            ClientError::Zmq(e) => write!(f, "zmq: {e}"),
            ClientError::Utility { message, kind } => write!(f, "{message} ({kind})"),
        }
    }
}

impl std::error::Error for ClientError {}

impl From<zmq::Error> for ClientError {
    fn from(e: zmq::Error) -> Self {
        ClientError::Zmq(e)
    }
}

impl From<WireError> for ClientError {
    fn from(e: WireError) -> Self {
        ClientError::Wire(e)
    }
}

pub type Result<T> = std::result::Result<T, ClientError>;

/// The engine's answer, checked: a refusal or another version is an error naming both versions.
pub fn check_ready(ready: EngineReady, ours: i64) -> Result<EngineReady> {
    if !ready.error.is_empty() {
        return Err(ClientError::ProtocolMismatch(ready.error));
    }
    if ready.protocol_version != ours {
        return Err(ClientError::ProtocolMismatch(format!(
            "protocol version mismatch: engine core speaks {}, this client speaks {ours}",
            ready.protocol_version
        )));
    }
    Ok(ready)
}

/// One connection to one engine core, as client `client_index`.
pub struct EngineCoreClient {
    _context: zmq::Context,
    input: zmq::Socket,
    output: zmq::Socket,
    pub client_index: i64,
    /// The handshake's answer: geometry, pid and the catch-up snapshot.
    pub ready: EngineReady,
    next_call_id: i64,
    /// Outputs that arrived while a utility call waited for its answer.
    pending: std::collections::VecDeque<EngineCoreOutputs>,
}

impl EngineCoreClient {
    /// Connect and shake hands with this build's protocol version.
    pub fn connect(
        input: &str,
        output: &str,
        client_index: i64,
        timeout: Duration,
    ) -> Result<Self> {
        Self::connect_speaking(input, output, client_index, timeout, PROTOCOL_VERSION)
    }

    /// Connect claiming `protocol_version` (an older or newer peer, for the handshake's tests).
    ///
    /// The hello is said again, on fresh sockets, every `HELLO_ATTEMPT` until the engine answers
    /// or `timeout` passes: an engine core that dies while this client starts takes the hello
    /// with it, and its next incarnation (the launcher starts it on the same addresses) must
    /// hear it again (`rankcast/engine_client/mp_client.py` does the same).
    pub fn connect_speaking(
        input: &str,
        output: &str,
        client_index: i64,
        timeout: Duration,
        protocol_version: i64,
    ) -> Result<Self> {
        let context = zmq::Context::new();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = left.min(HELLO_ATTEMPT);
            let (push, pull) = connect_pair(&context, input, output)?;
            let hello = EngineCoreInput::Hello(ClientHello {
                protocol_version,
                client_index,
            });
            push.send(to_bytes(&hello), 0)?;
            // A fault test's moment: the hello sent, its answer not read.
            hold_here(&format!("rust_api_server_{client_index}"), "hello");
            if let Some(ready) = await_ready(&pull, attempt)? {
                let ready = check_ready(ready, protocol_version)?;
                return Ok(EngineCoreClient {
                    _context: context,
                    input: push,
                    output: pull,
                    client_index,
                    ready,
                    next_call_id: 0,
                    pending: Default::default(),
                });
            }
            if Instant::now() >= deadline {
                return Err(ClientError::Timeout(format!(
                    "engine core did not answer the handshake in {:.0} s",
                    timeout.as_secs_f64()
                )));
            }
        }
    }

    /// The ZMQ context of this connection, for sockets that must share it (inproc).
    pub fn context(&self) -> &zmq::Context {
        &self._context
    }

    /// Wait until the engine's output or `other` is readable, or `timeout` passes:
    /// (output readable, other readable). Lets a caller block on both at once.
    pub fn wait_readable(&self, other: &zmq::Socket, timeout: Duration) -> Result<(bool, bool)> {
        let mut items = [
            self.output.as_poll_item(zmq::POLLIN),
            other.as_poll_item(zmq::POLLIN),
        ];
        zmq::poll(&mut items, timeout.as_millis().min(i64::MAX as u128) as i64)?;
        Ok((items[0].is_readable(), items[1].is_readable()))
    }

    fn send(&self, message: &EngineCoreInput) -> Result<()> {
        self.input.send(to_bytes(message), 0)?;
        Ok(())
    }

    pub fn add_request(&self, request: EngineCoreRequest) -> Result<()> {
        self.send(&EngineCoreInput::Add(request))
    }

    pub fn abort(&self, request_ids: Vec<String>) -> Result<()> {
        self.send(&EngineCoreInput::Abort(AbortRequests { request_ids }))
    }

    /// The next outputs (a step's, a flush's or a stats update), or None after `timeout`.
    pub fn next_outputs(&mut self, timeout: Option<Duration>) -> Result<Option<EngineCoreOutputs>> {
        if let Some(outputs) = self.pending.pop_front() {
            return Ok(Some(outputs));
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match receive(&self.output, left)? {
                Some(EngineCoreMessage::Outputs(outputs)) => return Ok(Some(outputs)),
                Some(EngineCoreMessage::Ready(_)) => continue, // a repeated handshake answer
                None => return Ok(None),
            }
        }
    }

    /// Call one of the engine's utilities and wait for its answer; outputs that arrive
    /// meanwhile are kept for `next_outputs`.
    pub fn call_utility(
        &mut self,
        method: &str,
        args: Vec<Value>,
        timeout: Duration,
    ) -> Result<Value> {
        let call_id = self.next_call_id;
        self.next_call_id += 1;
        let method = method.to_string();
        self.send(&EngineCoreInput::Utility(UtilityRequest {
            call_id,
            method,
            args,
        }))?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(message) = receive(&self.output, Some(left))? else {
                return Err(ClientError::Timeout(format!(
                    "utility call {call_id} got no answer"
                )));
            };
            let EngineCoreMessage::Outputs(mut outputs) = message else {
                continue;
            };
            match outputs.utility_output.take() {
                Some(UtilityOutput {
                    call_id: id,
                    result,
                    error,
                    error_kind,
                }) if id == call_id => {
                    return match error {
                        Some(message) => Err(ClientError::Utility {
                            message,
                            kind: error_kind,
                        }),
                        None => Ok(result),
                    };
                }
                _ => self.pending.push_back(outputs),
            }
        }
    }
}

/// A start-up hold (`rankcast/start_up_holds.py` says why and how): where the directory
/// `RANKCAST_START_UP_HOLDS` names holds `<role>@<point>`, rename it to `<role>@<point>.held` and
/// wait, in this thread only, until the test removes that file. Unset, nothing is held.
pub fn hold_here(role: &str, point: &str) {
    let Some(directory) = std::env::var_os("RANKCAST_START_UP_HOLDS").filter(|d| !d.is_empty())
    else {
        return;
    };
    let directory = std::path::PathBuf::from(directory);
    let armed = directory.join(format!("{role}@{point}"));
    let held = directory.join(format!("{role}@{point}.held"));
    if std::fs::rename(&armed, &held).is_err() {
        return;
    }
    eprintln!("rankcast-frontend: held at start-up point {point:?} (a fault test's hold)");
    while held.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How long one hello waits for its answer before it is said again on fresh sockets.
const HELLO_ATTEMPT: Duration = Duration::from_secs(2);

/// A PUSH to the engine's input and a PULL from its output, neither lingering when closed.
fn connect_pair(
    context: &zmq::Context,
    input: &str,
    output: &str,
) -> Result<(zmq::Socket, zmq::Socket)> {
    let push = context.socket(zmq::PUSH)?;
    push.set_linger(0)?;
    push.connect(input)?;
    let pull = context.socket(zmq::PULL)?;
    pull.set_linger(0)?;
    pull.connect(output)?;
    Ok((push, pull))
}

/// The `EngineReady` that answers a hello, or None when `within` passes first. What the engine
/// had queued for this client slot before (a previous connection of it, now gone: its stats
/// and outputs) may come first and is skipped.
fn await_ready(pull: &zmq::Socket, within: Duration) -> Result<Option<EngineReady>> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match receive(pull, Some(left))? {
            Some(EngineCoreMessage::Ready(ready)) => return Ok(Some(ready)),
            Some(EngineCoreMessage::Outputs(_)) => continue,
            None => return Ok(None),
        }
    }
}

/// One message from `socket`, or None when `timeout` passes first (None: wait forever).
fn receive(socket: &zmq::Socket, timeout: Option<Duration>) -> Result<Option<EngineCoreMessage>> {
    let millis = timeout.map_or(-1, |t| t.as_millis().min(i64::MAX as u128) as i64);
    if socket.poll(zmq::POLLIN, millis)? == 0 {
        return Ok(None);
    }
    let bytes = socket.recv_bytes(0)?;
    Ok(Some(from_bytes(&bytes)?))
}
