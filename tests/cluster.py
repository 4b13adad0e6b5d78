"""Real processes for the tests: a torchft Lighthouse, replica groups, their event files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from protocol.events import parse_event
from protocol.layout import GroupLayout
from service.controlplane.coverage import CoverageLedger
from service.controlplane.db import Store
from service.proctree import end_tree, signal_tree, wait_gone

REPO = Path(__file__).resolve().parents[1]


def read_events(events_dir: Path, group: int | None = None) -> list[dict]:
    """Every event of every rank (or of one group), in file order per rank."""
    events = []
    pattern = "*.jsonl" if group is None else GroupLayout(group).rank_events("*")
    for path in sorted(events_dir.glob(pattern)):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def stored(db: Path, type_: str) -> list[dict]:
    """The control plane's events of one type, from its SQLite file (when its API cannot be
    reached: another namespace, or the job has ended)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        return [json.loads(body) for (body,) in conn.execute("SELECT body FROM events WHERE type = ? ORDER BY id",
                                                            [type_])]


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2,
             explain: Callable[[], str] | None = None):
    """The predicate's first true value; at the deadline, an AssertionError that names ``what``
    and adds ``explain()`` (what the job looked like then: a CI run leaves nothing else)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                         + (f"\n{explain()}" if explain is not None else ""))


@dataclass
class TrainerGroup:
    """One replica group: ``python -m trainer`` (which becomes torchrun) in its own session."""

    group: int
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    host: list[str] = field(default_factory=list)
    """The prefix that runs it on another host (``tests/netns.py``); none: this one."""

    def start(self) -> "TrainerGroup":
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.host, sys.executable, "-m", "trainer", "--group", str(self.group), *self.args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        return self

    def kill(self) -> float:
        """SIGKILL the whole process tree at once, like losing the node; returns the time."""
        return kill_together([self])

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM to torchrun (it forwards it to the ranks), then SIGKILL whatever is left."""
        if self.proc is None:
            return None
        end_tree(self.proc, timeout_s)
        return self.proc.returncode

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def committed_steps(events: list[dict], group: int, rank: int = 0, since: float = 0.0) -> list[dict]:
    return [e for e in events if e["type"] == "step" and e["group"] == group and e["rank"] == rank
            and e["committed"] and e["ts"] >= since]


def lighthouse_on_host(net, i: int, owner) -> str:
    """A torchft Lighthouse on namespace host ``i`` of ``net`` (``tests/netns.py``), tuned as
    ``ftctl up`` tunes it, tagged by ``owner`` (``tests/processes.py``); its URL once it answers."""
    from protocol import defaults

    port = defaults.LIGHTHOUSE_PORT
    exe = str(Path(sys.executable).with_name("torchft_lighthouse"))
    subprocess.Popen([*net.run(i), exe, "--bind", f"{net.address(i)}:{port}", "--min_replicas", "1",
                      "--join_timeout_ms", str(defaults.JOIN_TIMEOUT_MS), "--quorum_tick_ms",
                      str(defaults.QUORUM_TICK_MS), "--heartbeat_timeout_ms", str(defaults.HEARTBEAT_TIMEOUT_MS)],
                     env={**owner.env(), "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    other = (i + 1) % net.count
    wait_for(lambda: subprocess.run([*net.run(other), "bash", "-c", f"exec 3<>/dev/tcp/{net.address(i)}/{port}"],
                                    capture_output=True).returncode == 0, 30, f"the Lighthouse on host {i}")
    return f"http://{net.address(i)}:{port}"


def groups_on_hosts(net, count: int, args: list[str], log_dir: Path, env: dict[str, str]) -> list[TrainerGroup]:
    """Groups 0 to ``count`` - 1 started on namespace hosts 1 to ``count`` of ``net``, each
    advertising its host's address (host 0 is the Lighthouse's, :func:`lighthouse_on_host`)."""
    return [TrainerGroup(g, [*args, "--advertise-host", net.address(g + 1)], log_dir / f"g{g}.log", env=env,
                         host=net.run(g + 1)).start() for g in range(count)]


def together(events_dir: Path, n: int, since: float = 0.0, members=(0, 1, 2)) -> bool:
    """Every one of ``members`` committed ``n`` steps with exactly them since ``since``."""
    events = read_events(events_dir)
    return all(len([e for e in committed_steps(events, g, since=since) if e["participants"] == len(members)]) >= n
               for g in members)


def resumed_s(events_dir: Path, since: float, survivors=(0, 1)) -> float:
    """From ``since`` to the first step the ``survivors`` committed without the others."""
    return min(e["ts"] for g in survivors for e in committed_steps(read_events(events_dir), g, since=since)
               if e["participants"] == len(survivors)) - since


def kill_together(groups: list[TrainerGroup]) -> float:
    """SIGKILL every process of every group in one sweep (a whole-job loss); returns the time."""
    when = time.time()
    pids = [pid for g in groups for pid in signal_tree(g.proc.pid, signal.SIGKILL)]
    for g in groups:
        g.proc.wait(timeout=30)
    assert not wait_gone(pids, 30), "processes survived SIGKILL"
    return when


SMALL = ["--ranks-per-group", "2", "--seq-len", "64", "--local-batch-size", "1", "--log-every", "5",
         "--fingerprint-every", "1"]


def job_args(lighthouse: str, tmp_path: Path, groups: int, steps: int, *extra: str) -> list[str]:
    return ["--lighthouse", lighthouse, "--groups", str(groups), "--steps", str(steps),
            "--events-dir", str(tmp_path / "events"), *SMALL, *extra]


def fingerprints(events: list[dict], group: int) -> dict[tuple[int, int], str]:
    return {(e["step"], e["rank"]): e["digest"] for e in events
            if e["type"] == "fingerprint" and e["group"] == group}


def coverage(events: list[dict], tmp_path: Path):
    """The control plane's coverage ledger fed every step event the ranks wrote."""
    ledger = CoverageLedger(Store(tmp_path / "coverage.db"))
    with ledger.store.transaction():
        for e in sorted((e for e in events if e["type"] == "step"), key=lambda e: e["ts"]):
            ledger.observe(parse_event(json.dumps(e)))
    return ledger.totals()
