"""The launcher process: `rankcast serve` reads the configuration, starts every engine core
and API server (Python or Rust), watches them and restarts the dead (fleet.py, supervision.py).
Nothing here runs in an API server or an engine core, except the child entry points in
children.py, the first code each child runs."""
