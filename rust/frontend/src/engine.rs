//! The engine core, seen from the HTTP side: one thread owns the ZMQ client (the zmq crate is
//! blocking), takes requests and aborts from a channel, and hands each request's outputs to the
//! task serving it. The thread sleeps in one poll on the engine's output socket and an inproc
//! doorbell that every command rings, so it costs nothing while idle and picks a request up at
//! once. When the engine core dies every stream gets an error and new requests are refused
//! (503), as the Python API server does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest};
use rankcast_client::EngineCoreClient;
use rankcast_frontend::engine_views::EngineViews;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::events::EventHub;
use crate::metrics::EngineMetrics;

const DOORBELL: &str = "inproc://rankcast-frontend-doorbell";
/// How long the engine may be silent before its process is checked for life.
const LIVENESS_CHECK: Duration = Duration::from_millis(250);

/// What a request's task receives: outputs as they come, or the engine's death.
pub enum Event {
    Output(EngineCoreOutput),
    EngineDead(String),
}

enum Command {
    Add(Box<EngineCoreRequest>, UnboundedSender<Event>),
    Abort(String),
}

#[derive(Clone)]
pub struct Engine {
    commands: mpsc::Sender<Command>,
    doorbell: Arc<Mutex<zmq::Socket>>,
    alive: Arc<AtomicBool>,
}

fn process_is_alive(pid: i64) -> bool {
    // SAFETY: kill with signal 0 only asks whether the process exists.
    pid > 0 && unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
}

/// The thread's side: the client, the requests in flight, where their outputs go.
struct Loop {
    client: EngineCoreClient,
    streams: HashMap<String, UnboundedSender<Event>>,
    metrics: Arc<EngineMetrics>,
    events: Arc<EventHub>,
    views: Arc<EngineViews>,
}

impl Loop {
    fn run_commands(&mut self, inbox: &mpsc::Receiver<Command>) {
        while let Ok(command) = inbox.try_recv() {
            let sent = match command {
                Command::Add(request, events) => {
                    self.streams.insert(request.request_id.clone(), events);
                    self.client.add_request(*request)
                }
                Command::Abort(id) => {
                    self.streams.remove(&id);
                    self.client.abort(vec![id])
                }
            };
            if let Err(e) = sent {
                eprintln!("rankcast-frontend: sending to the engine core: {e}");
            }
        }
    }

    fn deliver(&mut self, outputs: EngineCoreOutputs) {
        if let Some(stats) = &outputs.scheduler_stats {
            self.views.record_stats(outputs.engine_index, stats);
            self.metrics.record_stats(outputs.engine_index, stats);
        }
        if let Some(raws) = &outputs.engine_notifications {
            let decoded: Vec<Notification> =
                raws.iter().filter_map(|raw| raw.decode_as().ok()).collect();
            // The views first: the metrics render what they now hold.
            self.views.consume(outputs.engine_index, &decoded);
            self.metrics.consume(&decoded);
            self.events.consume(raws);
        }
        for output in outputs.outputs {
            let finished = output.finished();
            let id = output.request_id.clone();
            if let Some(events) = self.streams.get(&id) {
                let _ = events.send(Event::Output(output));
            }
            if finished {
                self.streams.remove(&id);
            }
        }
    }

    fn engine_died(&mut self, flag: &AtomicBool) {
        let pid = self.client.ready.pid;
        flag.store(false, Ordering::SeqCst);
        self.metrics
            .record_engine_up(self.client.ready.engine_index, false);
        let why = format!("engine core (pid {pid}) has exited");
        eprintln!("rankcast-frontend: {why}");
        for (_, events) in self.streams.drain() {
            let _ = events.send(Event::EngineDead(why.clone()));
        }
    }
}

impl Engine {
    /// Serve `client` on a thread of its own; the engine's snapshot-following state goes to
    /// `views`, the series derived from its stats to `metrics`, the notifications also to the
    /// `/v1/events` ring.
    pub fn start(
        client: EngineCoreClient,
        metrics: Arc<EngineMetrics>,
        events: Arc<EventHub>,
        views: Arc<EngineViews>,
    ) -> Engine {
        let (commands, inbox) = mpsc::channel::<Command>();
        let alive = Arc::new(AtomicBool::new(true));
        let bell = client
            .context()
            .socket(zmq::PULL)
            .expect("a doorbell socket");
        bell.bind(DOORBELL).expect("the doorbell's inproc address");
        let ring = client
            .context()
            .socket(zmq::PUSH)
            .expect("a doorbell socket");
        ring.connect(DOORBELL).expect("the doorbell");
        let flag = alive.clone();
        let mut state = Loop {
            client,
            streams: HashMap::new(),
            metrics,
            events,
            views,
        };
        std::thread::Builder::new()
            .name("engine-client".into())
            .spawn(move || loop {
                state.run_commands(&inbox);
                let (readable, rung) = match state.client.wait_readable(&bell, LIVENESS_CHECK) {
                    Ok(ready) => ready,
                    Err(e) => {
                        eprintln!("rankcast-frontend: polling the engine core: {e}");
                        (false, false)
                    }
                };
                while rung && bell.recv_bytes(zmq::DONTWAIT).is_ok() {}
                if readable {
                    // Everything that has arrived, without waiting for more.
                    loop {
                        match state.client.next_outputs(Some(Duration::ZERO)) {
                            Ok(Some(outputs)) => state.deliver(outputs),
                            Ok(None) => break,
                            Err(e) => {
                                eprintln!("rankcast-frontend: reading the engine core: {e}");
                                break;
                            }
                        }
                    }
                } else if !rung && !process_is_alive(state.client.ready.pid) {
                    state.engine_died(&flag);
                    return;
                }
            })
            .expect("the engine client thread");
        Engine {
            commands,
            doorbell: Arc::new(Mutex::new(ring)),
            alive,
        }
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    fn send(&self, command: Command) {
        if self.commands.send(command).is_err() {
            self.alive.store(false, Ordering::SeqCst);
            return;
        }
        let _ = self
            .doorbell
            .lock()
            .expect("doorbell lock")
            .send(&b""[..], zmq::DONTWAIT);
    }

    /// Submit `request`; its outputs arrive on the returned receiver.
    pub fn generate(&self, request: EngineCoreRequest) -> UnboundedReceiver<Event> {
        let (events, receiver) = unbounded_channel();
        self.send(Command::Add(Box::new(request), events));
        receiver
    }

    pub fn abort(&self, request_id: &str) {
        self.send(Command::Abort(request_id.to_string()));
    }
}
