"""Starts, kills, stops and restarts one replica group's torchrun process tree."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from protocol.events import ExitKind, ProcessEvent
from protocol.agent import LastExit
from protocol.quarantine import Quarantine
from protocol.defaults import LOOPBACK
from protocol.torchrun import free_port, torchrun_argv, torchrun_env
from service.agent.crash_line import log_size, read_crash_line
from service.agent.pidfile import forget_pid, reap_pidfile, record_pid
from service.agent.restarts import RestartPlan, RestartPolicy, restart_plan
from service.proctree import REAPED_S, descends_from, end_tree, process_tree, signal_tree, wait_gone

if TYPE_CHECKING:
    from service.agent.spare import WarmSpare
    from service.agent.zygote import ForkedGroup, Zygote

    GroupProcess = subprocess.Popen | ForkedGroup

log = logging.getLogger("agent.supervisor")
STOP_TIMEOUT_S = 30.0
"""A graceful stop: the ranks finish the step in flight (a checkpoint save among it) and write
their exit events; a group that takes longer is SIGKILLed."""


class StateConflict(Exception):
    """The command does not fit the group's state (kill while down, start while running)."""


@dataclass(frozen=True)
class GroupCommand:
    """How to start one group's torchrun: shared by the group itself and its warm spare."""

    group: int
    ranks_per_group: int
    trainer_args: list[str]
    master_addr: str | None
    log_path: Path
    stop_timeout_s: float = STOP_TIMEOUT_S
    zygote: "Zygote | None" = None

    def spawn(self, banner: str, extra_args: tuple[str, ...] = ()) -> "GroupProcess":
        """The group's ranks forked by the zygote, or else torchrun; in a session of their own,
        their output appended to the group's log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        trainer_args = [*self.trainer_args, *extra_args]
        if self.zygote is not None:
            forked = self.zygote.spawn(banner, trainer_args, self.ranks_per_group, self.master_addr or LOOPBACK,
                                       free_port(), self.log_path)
            if forked is not None:
                return forked
        argv = torchrun_argv(self.ranks_per_group, trainer_args, self.master_addr)
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {banner}\n".encode())
            out.flush()
            return subprocess.Popen(argv, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def stop(self, proc: "GroupProcess") -> None:
        """SIGTERM to the group's root, torchrun or the zygote's leader (each forwards it to the
        ranks), then SIGKILL whatever is left."""
        end_tree(proc, self.stop_timeout_s)


LIGHTHOUSE_POLL_S = 0.5
WENT_DOWN_BY_ITSELF: frozenset[ExitKind] = frozenset({"crashed", "hung"})
"""Exits nobody decided on: the group comes back by itself (with a restart policy)."""


@dataclass(frozen=True)
class Outcome:
    """What a command did: the processes it signalled or started, and the process event it
    caused, as the agent's forwarder sends it (the command's answer carries it too, so the
    control plane folds it in at once; its ``eid`` stores it once whichever arrives first)."""

    pids: list[int]
    event: ProcessEvent | None = None


class GroupSupervisor:
    def __init__(self, command: GroupCommand, pid_path: Path, on_event: Callable[..., ProcessEvent],
                 restart_policy: RestartPolicy | None, spare: "WarmSpare | None" = None,
                 lighthouse_away: Callable[[], str | None] = lambda: None,
                 take_quarantine: Callable[[], Quarantine | None] = lambda: None):
        """``lighthouse_away`` says why the Lighthouse takes no connection (None: it does). An
        automatic restart waits for it: a group started without it stops again at once, and a
        Lighthouse away long enough stops every group (exit reason lighthouse-away).
        ``take_quarantine`` reads why the group's ranks quarantined themselves (None: they did not).
        ``restart_policy``: how a group that went down by itself comes back (``service/agent/restarts.py``);
        None: it stays down until a rejoin."""
        self.command = command
        self.lighthouse_away = lighthouse_away
        self.take_quarantine = take_quarantine
        self.group = command.group
        self.pid_path = pid_path
        self.on_event = on_event
        self.restart_policy = restart_policy
        self.failures: list[float] = []
        """when the group went down by itself lately (the restart policy's window)"""
        self.restart_at: float | None = None
        """when the group starts again by itself, while a restart is planned"""
        self._planned: object | None = None
        """the planned restart's ticket: a start, or a later plan, voids it"""
        self.spare = spare
        self.proc: GroupProcess | None = None
        self.starts = 0
        self.last_exit: LastExit | None = None
        self._log_offset = 0
        """where the running start's output begins in the group's log"""
        self._intent: ExitKind | None = None
        self._lock = threading.RLock()
        self._shutdown = threading.Event()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    def pids(self) -> list[int]:
        return [p.pid for p in process_tree(self.proc.pid)] if self.running else []

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is one of the running group's processes."""
        proc = self.proc
        return proc is not None and self.running and descends_from(pid, proc.pid)

    def reap_orphans(self) -> list[int]:
        """Kill what a previous agent of this group left running: two copies must never train."""
        return reap_pidfile(self.pid_path, self.group) + (self.spare.reap() if self.spare else [])

    def start(self, why: str | None = None) -> Outcome:
        """Start the group: promote the warm spare when there is one, else start cold; ``why``
        is said in the started event (an automatic restart tells what it follows)."""
        with self._lock:
            if self.running:
                raise StateConflict(f"group {self.group} is already running (pid {self.proc.pid})")
            promoted = self.spare.promote() if self.spare else None
            if promoted is not None:
                self.proc, detail = promoted
            else:
                self.proc = self.command.spawn(f"starting group {self.group}")
                detail = "cold start"
            if why:
                detail = f"{detail}; {why}"
            # after the spawn: what a zygote that could not serve said while it was asked is not this start's
            self._log_offset = log_size(self.command.log_path)
            record_pid(self.pid_path, self.proc.pid, self.group)
            self.starts += 1
            self._intent = None
            self._planned = self.restart_at = None
            proc = self.proc
        event = self.on_event("started", pid=proc.pid, detail=detail)
        threading.Thread(target=self._watch, args=(proc,), name=f"watch-{proc.pid}", daemon=True).start()
        if self.spare:
            self.spare.replace_later(self._shutdown)
        return Outcome([proc.pid], event)

    def _watch(self, proc: "GroupProcess") -> None:
        """Report exits nobody asked for; kill() and drain() report their own, before returning,
        so a command that follows them (a rejoin) is always ordered after the exit."""
        code = proc.wait()
        with self._lock:
            if self._intent is not None or proc is not self.proc:
                return
        quarantine = self.take_quarantine()
        if quarantine is not None:
            self._exited(proc, "quarantined", quarantine.reason)
        elif code == 0:
            self._exited(proc, "finished")
        else:
            self._exited(proc, "crashed", read_crash_line(self.command.log_path, self._log_offset))

    def _exited(self, proc: "GroupProcess", kind: ExitKind, detail: str | None = None,
                fault: bool = False) -> ProcessEvent:
        """Report the exit and plan what follows it. ``fault``: a drill's kill standing for a
        node loss, which comes back like a crash but is not counted against the group."""
        code = proc.wait()
        forget_pid(self.pid_path, proc.pid)
        self.last_exit = LastExit(kind=kind, returncode=code, ts=time.time())
        log.info("group %d %s (exit code %s)%s", self.group, kind, code, f": {detail}" if detail else "")
        event = self.on_event(kind, pid=proc.pid, returncode=code, detail=detail)
        if self.restart_policy is not None and (kind in WENT_DOWN_BY_ITSELF or fault):
            self._plan_restart(kind, detail, counted=not fault)
        elif kind == "quarantined" and self.spare and self.spare.state() == "ready":
            self._replace_by_spare()
        return event

    def _plan_restart(self, kind: ExitKind, detail: str | None, counted: bool) -> None:
        """Start the group again by itself, when the restart policy says (a drill's fault: at once)."""
        policy, now = self.restart_policy, time.time()
        assert policy is not None
        ticket = object()
        with self._lock:
            if counted:
                self.failures = [t for t in self.failures if now - t < policy.window_s] + [now]
                plan = restart_plan(policy, self.failures, now)
            else:
                plan = RestartPlan(0.0, 0, crash_loop=False)
            self._planned, self.restart_at = ticket, now + plan.delay_s
        if plan.crash_loop:
            last = f"{kind}: {detail}" if detail else kind
            log.warning("group %d is crash-looping (%d unplanned exits in %g s, the last %s); held down for %g s",
                        self.group, plan.failures, policy.window_s, last, plan.delay_s)
            self.on_event("crash-loop", detail=f"{plan.failures} unplanned exits within {policy.window_s:g} s, "
                          f"the last {last}; held down, tried again in {plan.delay_s:g} s (or ftctl rejoin "
                          f"{self.group})")
            why = f"restarted by its agent after a crash-loop hold of {plan.delay_s:g} s"
        elif plan.delay_s > 0:
            why = (f"restarted by its agent after {kind}, unplanned exit {plan.failures} within {policy.window_s:g} s, "
                   f"after {plan.delay_s:g} s")
        else:
            why = f"restarted by its agent after {kind}"
        threading.Thread(target=self._restart_later, args=(ticket, plan.delay_s, why),
                         name=f"restart-{self.group}", daemon=True).start()

    def _replace_by_spare(self) -> None:
        """A quarantined group's ranks are not started again (their hardware is suspect); its
        warm spare, built elsewhere, takes its place and heals from a peer."""
        try:
            self.start()
        except StateConflict:
            pass

    def _restart_later(self, ticket: object, delay_s: float, why: str) -> None:
        if self._shutdown.wait(delay_s):
            return
        said = False
        while (away := self.lighthouse_away()) is not None:
            if not said:
                log.warning("group %d waits for the Lighthouse (%s) before it starts again", self.group, away)
                said = True
            if self._shutdown.wait(LIGHTHOUSE_POLL_S):
                return
        with self._lock:
            if self._planned is not ticket:
                return  # started since (a rejoin), or gone down again with a plan of its own
        try:
            self.start(why)
        except StateConflict:
            pass  # somebody rejoined it already

    def kill(self, fault: bool = False) -> Outcome:
        """SIGKILL the whole tree at once (torchrun and every rank), like losing the node. A
        person's kill stays down until a rejoin; a drill's (``fault``) comes back as a crash does."""
        return self._end_now("killed", fault=fault)

    def evict(self) -> Outcome:
        """SIGKILL the whole tree for good: the straggler policy, or an operator, evicted the group."""
        return self._end_now("evicted", "the control plane evicted it; its agent does not restart it")

    def end_hung(self, verdict: str) -> None:
        """The watchdog's verdict: SIGCONT (a stopped rank dies at once), then SIGKILL, the whole tree.
        A group already being killed or stopped is left to that."""
        try:
            self._end_now("hung", verdict)
        except StateConflict:
            pass

    def _end_now(self, kind: ExitKind, detail: str | None = None, fault: bool = False) -> Outcome:
        with self._lock:
            if not self.running or (kind == "hung" and self._intent is not None):
                raise StateConflict(f"group {self.group} is not running")
            self._intent = kind
            proc = self.proc
            if kind == "hung":
                signal_tree(proc.pid, signal.SIGCONT)
            pids = signal_tree(proc.pid, signal.SIGKILL)
        wait_gone(pids, REAPED_S)
        return Outcome(pids, self._exited(proc, kind, detail, fault))

    def drain(self, reason: str | None = None) -> Outcome:
        """Take the group out on purpose: its ranks finish the step in flight, commit it, stop
        heartbeating and exit (SIGTERM, then SIGKILL after the stop timeout); it stays down
        (``drained``) until a rejoin."""
        with self._lock:
            if not self.running:
                raise StateConflict(f"group {self.group} is not running")
            self._intent = "drained"
            proc = self.proc
        self.command.stop(proc)
        return Outcome([proc.pid], self._exited(proc, "drained", reason))

    def shutdown(self) -> None:
        self._shutdown.set()
        if self.spare:
            self.spare.stop()
        try:
            self.drain("its agent was stopped")
        except StateConflict:
            pass
