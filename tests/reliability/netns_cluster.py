"""Two Ray nodes as two hosts would be: the head in this network namespace, the other node in a
namespace of its own, joined by a veth pair with an address at each end, so the nodes reach each
other only over that link and by those addresses (no shared loopback).

Needs root and `ip` (iproute2); `netns_unavailable()` says why not where it cannot be made.
Every process started in the node's namespace is killed, and the namespace and the link removed,
when the cluster is closed, even after a failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HEAD_IP = "10.77.0.1"
NODE_IP = "10.77.0.2"
# What each Ray node is started with, the head and the other host's alike.
_NODE_ARGS = ("--num-cpus", "1", "--disable-usage-stats")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def netns_unavailable() -> str | None:
    """Why two network namespaces cannot be made here; None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rc-probe-{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class NetnsCluster:
    """A Ray head here and one more node in network namespace `namespace`."""

    tmp: Path
    port: int
    namespace: str = field(default_factory=lambda: f"rc-node-{os.getpid()}")
    head_link: str = field(default_factory=lambda: f"rch{os.getpid() % 100000}")
    node_link: str = field(default_factory=lambda: f"rcn{os.getpid() % 100000}")

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    def _env(self, link: str) -> dict[str, str]:
        # A private HOME (a stray ~/.ray/auth_token switches Ray to token auth); gloo binds the
        # link's address, not whatever the host name resolves to.
        return dict(
            os.environ,
            HOME=str(self.tmp / "home"),
            RAY_USAGE_STATS_ENABLED="0",
            GLOO_SOCKET_IFNAME=link,
        )

    def _ray(self, *args: str, namespace: str | None = None, link: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        run = subprocess.run(
            [*prefix, ray, *args],
            env=self._env(link),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)}: {run.stdout[-2000:]}{run.stderr[-2000:]}")

    def start(self) -> None:
        (self.tmp / "home").mkdir(parents=True, exist_ok=True)
        for command in (
            ["netns", "add", self.namespace],
            ["link", "add", self.head_link, "type", "veth", "peer", "name", self.node_link],
            ["link", "set", self.node_link, "netns", self.namespace],
            ["addr", "add", f"{HEAD_IP}/24", "dev", self.head_link],
            ["link", "set", self.head_link, "up"],
            ["-n", self.namespace, "addr", "add", f"{NODE_IP}/24", "dev", self.node_link],
            ["-n", self.namespace, "link", "set", self.node_link, "up"],
            ["-n", self.namespace, "link", "set", "lo", "up"],
        ):
            done = _ip(*command)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(command)}: {done.stderr.strip()}")
        self._ray(
            "start",
            "--head",
            "--node-ip-address",
            HEAD_IP,
            "--port",
            str(self.port),
            "--include-dashboard",
            "false",
            *_NODE_ARGS,
            link=self.head_link,
        )
        self.start_node()

    def start_node(self) -> None:
        """The other host's Ray node joins the head (again, after `kill_node`: a host back)."""
        self._ray(
            "start",
            "--address",
            self.address,
            "--node-ip-address",
            NODE_IP,
            *_NODE_ARGS,
            namespace=self.namespace,
            link=self.node_link,
        )

    def node_pids(self) -> list[int]:
        """Every process running in the node's namespace."""
        listed = _ip("netns", "pids", self.namespace)
        return [int(p) for p in listed.stdout.split()]

    def kill_node(self) -> None:
        """The other host dies: every process in its namespace, at once."""
        for pid in self.node_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.node_pids() and time.monotonic() < deadline:
            time.sleep(0.05)

    def cut_link(self) -> None:
        """A partition: the node lives on, but nothing reaches it (no reset, no answer)."""
        _ip("link", "set", self.head_link, "down")

    def close(self) -> None:
        self.kill_node()
        with contextlib.suppress(Exception):
            self._ray("stop", "--force", link=self.head_link)
        _ip("link", "del", self.head_link)  # removes its peer too
        _ip("netns", "del", self.namespace)
