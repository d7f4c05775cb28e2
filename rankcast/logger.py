"""Logging with the process role in every line, so interleaved logs of many processes read."""

from __future__ import annotations

import logging
import sys

from rankcast import envs


def init_logging(role: str) -> None:
    """Configure rankcast's loggers for this process; `role` is e.g. `engine_core_dp0`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("rankcast")
    root.handlers[:] = [handler]
    root.setLevel(envs.log_level())
    root.propagate = False
