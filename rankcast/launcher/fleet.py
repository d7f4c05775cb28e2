"""The launcher's children, watched from the moment each starts: one loop that starts, waits
for, restarts and gives up on engine cores and API servers alike.

Why one loop: a launcher that blocked on one child's start could not see a death elsewhere
meanwhile. An engine core killed while an API server was still starting was then never
restarted, and that API server waited on its handshake with a dead engine until a person
stopped the launcher. Here nothing blocks: each pass reads what every starting child said on
its readiness pipe, notes every death, and starts whatever is due.

The rules (docs/operations.md says the same for operators):
- Engine cores and API servers start together: an API server imports its libraries and loads
  its tokenizer while the model loads, then says its hello until every engine core answers.
  Its start is timed from the moment every engine core is up, so a long model load is not
  counted against it.
- A child that dies (killed, crashed, or an engine core that lost a rank) is started again
  under its role's restart rule (`supervision.py`), whether it was starting or serving.
- Before the fleet has started (every API server ready once), a child that reports an error
  of its own or does not become ready in time ends the launch: starting it again would fail
  the same way (a bad model file, a cache that does not fit), and the operator is waiting at
  the terminal. So does a role given up on before then. After that, such failures count
  towards the restart rule like deaths.
- A dead API server is restarted only while every engine core's process is up (starting or
  serving): it connects to all of them, and says its hello again until each answers.
- `/health` answers 503 until the fleet has started (the state file says so), so a load
  balancer never sees "ready" from the first API server of a fleet still coming up.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rankcast.launcher.descendants import reap_adopted
from rankcast.launcher.supervision import Supervision
from rankcast.process import remove_ipc_dirs_of
from rankcast.supervisor_state import FleetState, SupervisorState, write_state

logger = logging.getLogger(__name__)

# How long a child may take to report ready: an engine core loads (and may first convert) the
# model; an API server only loads the tokenizer and connects.
ENGINE_START_TIMEOUT_S = 900.0
API_SERVER_START_TIMEOUT_S = 300.0
# The loop wakes at once for a readiness message or a death; this bounds how late it sees a
# stop request and a back-off that has run out.
_PASS_S = 0.2

# (process name, target, args): a child to start; the readiness pipe is appended to args.
ChildSpec = tuple[str, Callable[..., None], tuple[Any, ...]]


class LaunchError(RuntimeError):
    """The fleet could not start; the message says which process and why."""


class StoppedDuringStartUp(LaunchError):
    """SIGTERM or SIGINT arrived while children were still starting: not a failure."""


@dataclass
class _Child:
    """One started process and what it has said on its readiness pipe."""

    proc: BaseProcess
    pipe: Connection
    started: float  # monotonic
    ready_at: float | None = None  # monotonic, once it said "ready"
    words: str | None = None  # why it failed, if it said so before dying

    @property
    def ready(self) -> bool:
        return self.ready_at is not None


@dataclass(eq=False)  # a place in the fleet is itself, whatever it holds
class Role:
    """One place in the fleet (an engine core, an API server): how to start its process, the
    restart bookkeeping, and the process now in it (None while dead)."""

    supervision: Supervision
    spec: Callable[[int], ChildSpec]  # incarnation -> what to start
    start_timeout_s: float
    child: _Child | None = None

    @property
    def name(self) -> str:
        return self.supervision.role

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.proc.is_alive()

    @property
    def process(self) -> BaseProcess | None:
        return None if self.child is None else self.child.proc


@dataclass
class Fleet:
    """Every role `rankcast serve` runs, and the loop that keeps them running."""

    spawn: SpawnContext
    engines: list[Role]
    api_servers: list[Role]
    state_path: Path
    stop: threading.Event
    on_started: Callable[[], None] = lambda: None  # the banner
    started: bool = False  # every API server has been ready once
    # Readable once a stop signal arrived (serve.py's `_stop_on_signals`): waited on beside the
    # children, so a stop begins at once rather than at the next pass.
    woken: socket.socket | None = None

    def processes(self) -> Iterator[BaseProcess]:
        """The processes in the fleet's places now."""
        for role in (*self.api_servers, *self.engines):
            if role.process is not None:
                yield role.process

    def run(self) -> int:
        """Start the fleet and keep it running until a stop (0) or until no API server is left
        that could come back (1). Raises LaunchError when the fleet cannot start, and
        StoppedDuringStartUp when told to stop before it has."""
        for role in (*self.engines, *self.api_servers):
            self._start(role)
        self._write()
        while True:
            self._wait_for_news()
            if self.stop.is_set():
                if not self.started:
                    starting = [r.name for r in self._roles() if not self._ready(r)]
                    raise StoppedDuringStartUp(
                        f"stopped during the start, while {', '.join(starting)} "
                        f"{'was' if len(starting) == 1 else 'were'} not yet ready"
                    )
                return 0
            reap_adopted({p.pid for p in self.processes() if p.pid})
            changed = any([self._watch(role) for role in self._roles()])
            changed |= self._start_what_is_due()
            if not self.started and all(self._ready(r) for r in self._roles()):
                self.started = True
                changed = True
                self.on_started()
            if changed:
                self._write()
            if self.started and not any(self._may_serve(r) for r in self.api_servers):
                logger.error("every API server has exited and none can be started again")
                return 1

    # ---- one pass ----

    def _roles(self) -> list[Role]:
        return [*self.engines, *self.api_servers]

    @staticmethod
    def _ready(role: Role) -> bool:
        return role.child is not None and role.child.ready

    def _wait_for_news(self) -> None:
        """Sleep until a starting child says something, any child exits, or a pass is due."""
        waitables: list[Any] = []
        for role in self._roles():
            if role.child is not None:
                waitables.append(role.child.proc.sentinel)
                if not role.child.ready:
                    waitables.append(role.child.pipe)
        if self.woken is not None:
            waitables.append(self.woken)
        if waitables:
            wait(waitables, timeout=_PASS_S)
        else:
            self.stop.wait(_PASS_S)
        if self.woken is not None:
            with contextlib.suppress(BlockingIOError):
                while self.woken.recv(64):
                    pass

    def _watch(self, role: Role) -> bool:
        """Read what `role`'s child said, note its death or its overrun start; True when
        something changed."""
        child = role.child
        if child is None:
            return False
        changed = False
        if not child.ready:
            changed = self._read_pipe(role, child)
            if role.child is None:
                return True
        if child.proc.sentinel in wait([child.proc.sentinel], 0):
            why = self._death(child)
            self._clear(role)
            self._failed(role, why)
            return True
        if not child.ready and self._overdue(role, child):
            why = f"did not become ready in {role.start_timeout_s:.0f} s"
            self._end(role)
            if not self.started:
                raise LaunchError(f"{role.name} {why}")
            self._failed(role, why)
            return True
        return changed

    def _overdue(self, role: Role, child: _Child) -> bool:
        """Whether a starting child has taken longer than its role allows: an engine core from
        its start, an API server from when every engine core was up (its handshake waits for
        them)."""
        since = child.started
        if role in self.api_servers:
            engines_ready = [e.child.ready_at if e.child else None for e in self.engines]
            if None in engines_ready:
                return False
            since = max(since, *(t for t in engines_ready if t is not None))
        return time.monotonic() - since > role.start_timeout_s

    def _read_pipe(self, role: Role, child: _Child) -> bool:
        """What a starting child said: "ready"; "error" (a failure of its own: fatal before
        the fleet has started); "lost" (something below it died: a death, told why)."""
        changed = False
        with contextlib.suppress(EOFError, OSError):
            while child.pipe.poll(0):
                kind, *detail = child.pipe.recv()
                why = str(detail[0]) if detail else kind
                if kind == "ready":
                    child.ready_at = time.monotonic()
                    role.supervision.ready()
                    return True
                if kind == "lost":
                    child.words = why  # it exits next; its death is told with this reason
                    changed = True
                elif kind == "error":
                    if self.stop.is_set():
                        return changed  # a child the stop interrupted says so: not a failure
                    self._end(role)
                    if not self.started:
                        raise LaunchError(f"{role.name} failed to start: {why}")
                    self._failed(role, f"failed to start: {why}")
                    return True
        return changed

    @staticmethod
    def _death(child: _Child) -> str:
        """Why a child that exited is gone: its exit code, and what it said of it (an engine
        core's last words after ready come on its pipe as ("failed", why))."""
        child.proc.join(5)
        code = child.proc.exitcode
        if child.ready:
            why = f"exited (code {code})"
            with contextlib.suppress(EOFError, OSError):
                while child.pipe.poll(0):
                    kind, *detail = child.pipe.recv()
                    if kind == "failed" and detail:
                        child.words = str(detail[0])
        else:
            why = f"exited during start-up (exit code {code})"
        return f"{why}: {child.words}" if child.words else why

    def _failed(self, role: Role, why: str) -> None:
        if self.stop.is_set():
            return  # the stop's own casualties are not failures
        role.supervision.failed(why)
        if role.supervision.given_up is not None and not self.started:
            raise LaunchError(role.supervision.given_up)

    def _end(self, role: Role) -> None:
        """Kill the child in `role` (it failed; it gets no second chance to finish)."""
        if role.child is not None and role.child.proc.is_alive():
            role.child.proc.kill()
        self._clear(role)

    @staticmethod
    def _clear(role: Role) -> None:
        """Empty `role`'s place once its process is gone, removing the IPC directories a
        killed process could not."""
        child = role.child
        if child is None:
            return
        child.proc.join(5)
        child.pipe.close()
        if child.proc.pid is not None:
            remove_ipc_dirs_of(child.proc.pid)
        role.child = None

    def _may_serve(self, role: Role) -> bool:
        """Whether an API server serves, or will again."""
        if role.child is not None:
            return True
        if role.supervision.given_up is not None:
            return False
        return not any(engine.supervision.given_up for engine in self.engines)

    def _start_what_is_due(self) -> bool:
        """Restart the roles whose back-off has run out."""
        if self.stop.is_set():
            return False
        changed = False
        for role in self.engines:
            if role.child is None and role.supervision.due():
                role.supervision.restarting()
                self._start(role)
                changed = True
        engines_up = all(engine.alive for engine in self.engines)
        for role in self.api_servers:
            if role.child is None and role.supervision.due() and engines_up:
                role.supervision.restarting()
                self._start(role)
                changed = True
        return changed

    def _start(self, role: Role) -> None:
        name, target, args = role.spec(role.supervision.incarnation)
        read, write = self.spawn.Pipe(duplex=False)
        proc = self.spawn.Process(target=target, args=(*args, write), name=name)
        proc.start()
        write.close()
        role.child = _Child(proc, read, time.monotonic())

    def _write(self) -> None:
        ready = sum(self._ready(role) for role in self.api_servers)
        total = len(self.api_servers)
        if self.started:
            fleet = FleetState(state="serving", api_servers=total, api_servers_ready=ready)
        else:
            waiting = [r.name for r in self._roles() if not self._ready(r)]
            fleet = FleetState(
                state="starting",
                api_servers=total,
                api_servers_ready=ready,
                message=f"the fleet is starting: {ready} of {total} API servers ready; "
                f"waiting for {', '.join(waiting)}",
            )
        engines = [role.supervision.state() for role in self.engines]
        write_state(self.state_path, SupervisorState(fleet=fleet, engines=engines))
