//! Stopping as the Python API servers stop (docs: graceful drain). On SIGTERM or SIGINT the
//! server answers every new request, `/health` included, with 503 and `Retry-After` (the
//! listening socket stays open, so a load balancer sees the refusal rather than a reset);
//! requests in flight get `--shutdown-timeout` seconds to finish; then the rest are cut (a
//! stream gets a last chunk with finish reason "abort", an error naming the timeout and
//! `[DONE]`), and the process exits 0.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub const RETRY_AFTER_S: u64 = 5;

pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    pub timeout: Duration,
    cut: watch::Sender<bool>,
}

/// Counts one request in flight for as long as it lives.
pub struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drain {
    pub fn new(timeout: Duration) -> Arc<Drain> {
        let (cut, _) = watch::channel(false);
        Arc::new(Drain {
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            timeout,
            cut,
        })
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Completions in flight on this server (what `/load` reports, as vLLM's counts them).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    pub fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Resolves when requests still running must be ended.
    pub fn cut_signal(&self) -> watch::Receiver<bool> {
        self.cut.subscribe()
    }

    pub fn message(&self) -> String {
        format!(
            "The server is shutting down; the request did not finish within --shutdown-timeout \
             ({} s).",
            self.timeout.as_secs_f64()
        )
    }

    /// After a stop was asked for: wait for the requests in flight, cut them at the timeout,
    /// give the cut ones a moment to write their last chunks, then exit.
    pub async fn run(self: Arc<Self>) {
        self.draining.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let tick = Duration::from_millis(20);
        while self.in_flight.load(Ordering::SeqCst) > 0 && started.elapsed() < self.timeout {
            tokio::time::sleep(tick).await;
        }
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            let _ = self.cut.send(true);
            let grace = Instant::now();
            while self.in_flight.load(Ordering::SeqCst) > 0
                && grace.elapsed() < Duration::from_secs(2)
            {
                tokio::time::sleep(tick).await;
            }
        }
        std::process::exit(0);
    }
}

/// Block SIGTERM and SIGINT in this thread (and every thread it starts from now on) and wait
/// for them on a thread of their own; the first one sends on the returned channel.
pub fn stop_signals() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    // SAFETY: sigset manipulation on a local set; pthread_sigmask affects this thread only, and
    // the threads started after it inherit the mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    std::thread::Builder::new()
        .name("stop-signals".into())
        .spawn(move || {
            let mut signal: libc::c_int = 0;
            // SAFETY: waits on the set built above; the signals are blocked in every thread.
            unsafe { libc::sigwait(&set, &mut signal) };
            let _ = tx.send(());
        })
        .expect("the signal thread");
    rx
}
