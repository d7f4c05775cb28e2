//! The engine core, seen from the HTTP side: one thread owns the ZMQ client (the zmq crate is
//! blocking), takes requests and aborts from a channel, and hands each request's outputs to the
//! task serving it. When the engine core dies every stream gets an error and new requests are
//! refused (503), as the Python API server does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rankcast_client::wire::notifications::Notification;
use rankcast_client::wire::protocol::{EngineCoreOutput, EngineCoreRequest};
use rankcast_client::EngineCoreClient;

use crate::events::EventHub;
use crate::metrics::EngineMetrics;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

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
    alive: Arc<AtomicBool>,
}

fn process_is_alive(pid: i64) -> bool {
    // SAFETY: kill with signal 0 only asks whether the process exists.
    pid > 0 && unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
}

impl Engine {
    /// Serve `client` on a thread of its own; the engine-derived series go to `metrics`, the
    /// notifications also to the `/v1/events` ring.
    pub fn start(
        mut client: EngineCoreClient,
        metrics: Arc<EngineMetrics>,
        events: Arc<EventHub>,
    ) -> Engine {
        let (commands, inbox) = mpsc::channel::<Command>();
        let alive = Arc::new(AtomicBool::new(true));
        let flag = alive.clone();
        std::thread::Builder::new()
            .name("engine-client".into())
            .spawn(move || {
                let mut streams: HashMap<String, UnboundedSender<Event>> = HashMap::new();
                let pid = client.ready.pid;
                let mut quiet = Duration::ZERO;
                loop {
                    while let Ok(command) = inbox.try_recv() {
                        let sent = match command {
                            Command::Add(request, events) => {
                                streams.insert(request.request_id.clone(), events);
                                client.add_request(*request)
                            }
                            Command::Abort(id) => {
                                streams.remove(&id);
                                client.abort(vec![id])
                            }
                        };
                        if let Err(e) = sent {
                            eprintln!("rankcast-frontend: sending to the engine core: {e}");
                        }
                    }
                    let wait = Duration::from_millis(2);
                    match client.next_outputs(Some(wait)) {
                        Ok(Some(outputs)) => {
                            quiet = Duration::ZERO;
                            if let Some(stats) = &outputs.scheduler_stats {
                                metrics.record_stats(outputs.engine_index, stats);
                            }
                            if let Some(raws) = &outputs.engine_notifications {
                                let decoded: Vec<Notification> =
                                    raws.iter().filter_map(|raw| raw.decode_as().ok()).collect();
                                metrics.consume(&decoded);
                                events.consume(raws);
                            }
                            for output in outputs.outputs {
                                let finished = output.finished();
                                let id = output.request_id.clone();
                                if let Some(events) = streams.get(&id) {
                                    let _ = events.send(Event::Output(output));
                                }
                                if finished {
                                    streams.remove(&id);
                                }
                            }
                        }
                        Ok(None) => {
                            quiet += wait;
                            if quiet >= Duration::from_millis(250) {
                                quiet = Duration::ZERO;
                                if !process_is_alive(pid) {
                                    flag.store(false, Ordering::SeqCst);
                                    metrics.record_engine_up(client.ready.engine_index, false);
                                    let why = format!("engine core (pid {pid}) has exited");
                                    eprintln!("rankcast-frontend: {why}");
                                    for (_, events) in streams.drain() {
                                        let _ = events.send(Event::EngineDead(why.clone()));
                                    }
                                    return;
                                }
                            }
                        }
                        Err(e) => {
                            eprintln!("rankcast-frontend: reading the engine core: {e}");
                        }
                    }
                }
            })
            .expect("the engine client thread");
        Engine { commands, alive }
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Submit `request`; its outputs arrive on the returned receiver.
    pub fn generate(&self, request: EngineCoreRequest) -> UnboundedReceiver<Event> {
        let (events, receiver) = unbounded_channel();
        if self
            .commands
            .send(Command::Add(Box::new(request), events))
            .is_err()
        {
            self.alive.store(false, Ordering::SeqCst);
        }
        receiver
    }

    pub fn abort(&self, request_id: &str) {
        let _ = self.commands.send(Command::Abort(request_id.to_string()));
    }
}
