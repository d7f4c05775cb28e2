//! Whether the fleet `rankcast serve` runs has started, as its launcher's state file says
//! (`RANKCAST_SUPERVISOR_STATE`, written by `rankcast/launcher/fleet.py`): until every API
//! server has been ready once, `/health` answers 503 on every server, Python or Rust, so a load
//! balancer never takes the first server up for a fleet that is still coming up.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;

pub struct FleetStart {
    /// The launcher's state file; None outside `rankcast serve` (nothing to wait for).
    path: Option<PathBuf>,
    /// Seen started once: for good, and the file is not read again.
    started: AtomicBool,
}

impl FleetStart {
    pub fn from_env() -> FleetStart {
        let path = std::env::var_os("RANKCAST_SUPERVISOR_STATE")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        FleetStart {
            started: AtomicBool::new(path.is_none()),
            path,
        }
    }

    /// The file's `fleet` object while the fleet is still starting; None once it has started.
    pub fn starting(&self) -> Option<Value> {
        if self.started.load(Ordering::Relaxed) {
            return None;
        }
        let text = std::fs::read_to_string(self.path.as_ref()?).ok()?;
        let fleet = serde_json::from_str::<Value>(&text)
            .ok()?
            .get("fleet")?
            .clone();
        if fleet.get("state").and_then(Value::as_str) == Some("serving") {
            self.started.store(true, Ordering::Relaxed);
            return None;
        }
        Some(fleet)
    }
}
