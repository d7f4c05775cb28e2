//! `rankcast-frontend`: an API server in Rust, one more client of the engine core next to the
//! Python ones. It speaks the same wire (rust/wire), tokenizes with the model's own BPE
//! (rust/text), and shares the port with the other API servers through SO_REUSEPORT.
//!
//!     rankcast-frontend --model-dir DIR --served-model-name NAME --port N [--host H]
//!                       --engine-input ADDR --engine-output ADDR --client-index K
//!                       [--api-key KEY] [--shutdown-timeout SECONDS] [--model-origin WHERE]
//!                       [--reasoning-parser qwen3] [--tool-call-parser hermes]
//!                       [--block-size N] [--enable-prefix-caching true|false]
//!                       [--data-parallel-size N] [--kv-events-config JSON]
//!                       [--kv-event-sources JSON] [--speculative-config JSON]
//!
//! The parsers read chat outputs as the Python servers' flags of the same names do (the
//! launcher gives `--tool-call-parser` only with `--enable-auto-tool-choice`, which serves
//! `tool_choice` auto): a fleet parses on every server or on none. The last six are what
//! routers' discovery asks (`/get_server_info`, `/kv_event_sources`), as the launcher's
//! configuration has them; the JSON ones are written by the Python side and answered as given.

mod chat;
mod dashboard;
mod drain;
mod engine;
mod events;
mod exposition;
mod families;
mod fields;
mod fleet_start;
mod generation;
mod logprobs;
mod lora_metrics;
mod metrics;
#[cfg(test)]
mod metrics_spec;
mod multiprocess;
mod openai;
mod request_metrics;
mod route_metrics;
mod routes;
mod sampling;
mod shape;

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::{make_service_fn, service_fn};
use rankcast_client::EngineCoreClient;
use rankcast_frontend::engine_views::EngineViews;
use rankcast_frontend::pyjson::Json;
use rankcast_text::Tokenizer;

struct Args {
    model_dir: PathBuf,
    model_name: String,
    host: String,
    port: u16,
    engine_input: String,
    engine_output: String,
    client_index: i64,
    api_key: Option<String>,
    shutdown_timeout: Duration,
    model_origin: String,
    parsers: openai::Parsers,
    discovery: openai::Discovery,
}

fn fail(message: &str) -> ! {
    eprintln!("rankcast-frontend: error: {message}");
    std::process::exit(1);
}

fn parse() -> Args {
    let mut values = std::collections::HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else {
            fail(&format!("{flag} needs a value"))
        };
        values.insert(flag, value);
    }
    let mut take = |key: &str| {
        values
            .remove(key)
            .unwrap_or_else(|| fail(&format!("{key} is required")))
    };
    let model_dir = PathBuf::from(take("--model-dir"));
    let args = Args {
        model_name: take("--served-model-name"),
        port: take("--port")
            .parse()
            .unwrap_or_else(|_| fail("--port: a port number")),
        engine_input: take("--engine-input"),
        engine_output: take("--engine-output"),
        client_index: take("--client-index")
            .parse()
            .unwrap_or_else(|_| fail("--client-index")),
        host: values
            .remove("--host")
            .unwrap_or_else(|| "127.0.0.1".into()),
        api_key: values.remove("--api-key"),
        model_origin: values.remove("--model-origin").unwrap_or_default(),
        shutdown_timeout: values.remove("--shutdown-timeout").map_or(
            Duration::from_secs(30),
            |v| {
                Duration::from_secs_f64(
                    v.parse()
                        .unwrap_or_else(|_| fail("--shutdown-timeout: seconds")),
                )
            },
        ),
        parsers: openai::Parsers {
            qwen3_reasoning: one_of(
                values.remove("--reasoning-parser"),
                "--reasoning-parser",
                "qwen3",
            ),
            hermes_tools: one_of(
                values.remove("--tool-call-parser"),
                "--tool-call-parser",
                "hermes",
            ),
        },
        discovery: discovery_flags(&mut values),
        model_dir,
    };
    if let Some(unknown) = values.keys().next() {
        fail(&format!("unknown option {unknown}"));
    }
    args
}

/// What discovery answers, from its flags (each absent one as `ApiServerConfig` defaults it).
fn discovery_flags(values: &mut std::collections::HashMap<String, String>) -> openai::Discovery {
    let mut found = openai::Discovery::default();
    let mut number = |flag: &str, default: i64| {
        values.remove(flag).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| fail(&format!("{flag}: an integer")))
        })
    };
    found.block_size = number("--block-size", found.block_size);
    found.data_parallel_size = number("--data-parallel-size", found.data_parallel_size);
    if let Some(v) = values.remove("--enable-prefix-caching") {
        found.enable_prefix_caching = match v.as_str() {
            "true" => true,
            "false" => false,
            _ => fail("--enable-prefix-caching: true or false"),
        };
    }
    let mut json = |flag: &str, into: &mut Json| {
        if let Some(text) = values.remove(flag) {
            *into = Json::parse(&text).unwrap_or_else(|| fail(&format!("{flag}: JSON")));
        }
    };
    json("--kv-events-config", &mut found.kv_events_config);
    json("--kv-event-sources", &mut found.kv_event_sources);
    json("--speculative-config", &mut found.speculative_config);
    found
}

/// Whether a flag whose only value is `known` was given (any other value is an error).
fn one_of(value: Option<String>, flag: &str, known: &str) -> bool {
    match value {
        None => false,
        Some(v) if v == known => true,
        Some(v) => fail(&format!(
            "{flag}: {known} is the one this server has, got {v:?}"
        )),
    }
}

/// A listening socket on `addr` that shares its port with the other API servers.
fn shared_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket calls on a descriptor this function owns until it is wrapped.
    unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let listener = TcpListener::from_raw_fd(fd);
        let one: libc::c_int = 1;
        for option in [libc::SO_REUSEADDR, libc::SO_REUSEPORT] {
            let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            let value = &one as *const libc::c_int as *const libc::c_void;
            if libc::setsockopt(fd, libc::SOL_SOCKET, option, value, size) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let rc = match addr {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(*v4.ip()).to_be(),
                    },
                    sin_zero: [0; 8],
                };
                let size = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                libc::bind(
                    fd,
                    &sin as *const libc::sockaddr_in as *const libc::sockaddr,
                    size,
                )
            }
            SocketAddr::V6(_) => {
                return Err(std::io::Error::other("IPv6 hosts are not supported yet"))
            }
        };
        if rc != 0 || libc::listen(fd, 1024) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        listener.set_nonblocking(true)?;
        Ok(listener)
    }
}

fn main() {
    // First, before any thread starts: every thread inherits the blocked stop signals.
    let stop = drain::stop_signals();
    // A keeper (or launcher) that dies leaves no server behind: SIGTERM, which drains.
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets this process's parent-death signal.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    let args = parse();
    let tokenizer = Tokenizer::from_file(&args.model_dir.join("tokenizer.json"))
        .unwrap_or_else(|e| fail(&e.to_string()));
    let template = chat::ChatTemplate::load(&args.model_dir).unwrap_or_else(|e| fail(&e));
    // Started beside a loading engine core: longer than the launcher lets an engine core take
    // to start (900 s), so that the launcher, which watches both, decides when a start failed.
    let client = EngineCoreClient::connect(
        &args.engine_input,
        &args.engine_output,
        args.client_index,
        Duration::from_secs(1200),
    )
    .unwrap_or_else(|e| fail(&e.to_string()));
    let max_model_len = client.ready.max_model_len;
    let engine_index = client.ready.engine_index;
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .unwrap_or_else(|_| fail("--host: an IP address"));
    let listener = shared_listener(addr).unwrap_or_else(|e| fail(&format!("binding {addr}: {e}")));
    // The launcher's directory for the series every API server counts and the fleet sums.
    let fleet_directory = std::env::var_os("PROMETHEUS_MULTIPROC_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from);
    let requests =
        request_metrics::RequestMetrics::new(&args.model_name, args.client_index, fleet_directory);
    // This server's view of its engine: what admission, the adapter routes and /metrics read.
    let views = Arc::new(EngineViews::new([engine_index]));
    let metrics = Arc::new(metrics::EngineMetrics::new(
        &args.model_name,
        requests,
        views.clone(),
    ));
    if let Some(snapshot) = &client.ready.snapshot {
        views.apply_snapshot(snapshot);
        metrics.apply_snapshot(snapshot);
    }
    metrics.record_engine_up(client.ready.engine_index, true);
    let events = Arc::new(events::EventHub::default());
    if let Some(snapshot) = &client.ready.snapshot {
        events.apply_snapshot(
            snapshot.engine_index,
            snapshot.engine_seq,
            snapshot.incarnation,
        );
    }
    let server = Arc::new(openai::Server {
        engine: engine::Engine::start(client, metrics.clone(), events.clone(), views.clone()),
        views,
        model_origin: args.model_origin,
        metrics,
        events,
        tokenizer,
        template,
        model_name: args.model_name,
        max_model_len,
        engine_index,
        client_index: args.client_index,
        api_key: args.api_key,
        counter: AtomicU64::new(0),
        drain: drain::Drain::new(args.shutdown_timeout),
        fleet: fleet_start::FleetStart::from_env(),
        parsers: args.parsers,
        discovery: args.discovery,
    });
    let drain = server.drain.clone();
    let stopping_events = server.events.clone();
    let watched = server.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        tokio::spawn(async move {
            if stop.await.is_ok() {
                eprintln!("rankcast-frontend: stopping: requests in flight get up to {:?}", drain.timeout);
                stopping_events.close(); // event streams would hold the drain otherwise
                drain.run().await;
            }
        });
        // A dead engine core: after the streams had a moment to end, exit, so that the launcher
        // starts this server again once the engine is back (its new incarnation's handshake).
        tokio::spawn(async move {
            while watched.engine.alive() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            if !watched.drain.draining() {
                eprintln!("rankcast-frontend: the engine core is gone; exiting to be restarted");
                std::process::exit(1);
            }
        });
        let make = make_service_fn(move |_| {
            let server = server.clone();
            async move {
                Ok::<_, Infallible>(service_fn(move |request| server.clone().handle(request)))
            }
        });
        let http = hyper::Server::from_tcp(listener)
            .unwrap_or_else(|e| fail(&e.to_string()))
            // Streamed chunks are small writes: without this, Nagle's algorithm and the
            // client's delayed ACK hold each one back ~40 ms.
            .tcp_nodelay(true);
        eprintln!("rankcast-frontend: serving on http://{addr} as API server {}", args.client_index);
        if let Err(e) = http.serve(make).await {
            fail(&e.to_string());
        }
    });
}
