"""torchft's Lighthouse alone: how many groups it holds at each step time, and where its time goes.

    python -m bench.lighthouse --groups 128 256 512 [--step-s 1.0] [--duration 30] [--kill-every 10] [--profile]

``bench.scale`` measures the Lighthouse with everything else of the service around it, on the
same two cores. Here there is only torchft's own ``torchft_lighthouse`` (1 s heartbeat and join
timeouts, as the service runs it) and ``--workers`` processes of thin clients: each group is a
thread that asks for a quorum through torchft's ``LighthouseClient`` exactly as a group's rank 0
does, then "computes" for ``--step-s``; one thread per worker heartbeats every group every
``--heartbeat-s`` (torchft's Manager: 100 ms). Nothing else: no events, no control plane.

Every ``--kill-every`` seconds worker 0 kills one of its groups (it stops heartbeating and
asking at once, as a SIGKILLed group does) and restarts it ``--rejoin-after-s`` later under a new
replica id, as a restarted group comes back. It reports, over ``--duration`` seconds once every
group has had a quorum:

- quorum latency p50/p99 as the groups see it (request to answer), and failed requests;
- kill → the first quorum one of worker 0's groups receives without the killed replica;
- the rounds (a quorum answer for every group), the distinct quorums (torchft keeps the id while
  the members stay), the fewest and most members, and the Lighthouse's CPU in cores and in
  core-seconds per round (the part that grows with the square of the group count);
- ``--profile``: where the Lighthouse's CPU goes (``perf record``; Debian's ``linux-perf``): the
  30 functions with the largest share of its samples, in the JSON.

Writes bench/results/lighthouse-*.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil

from bench.common import write_result
from bench.scale import add_quorum_options, fmt, summary
from lighthouse.config import LighthouseSettings
from protocol.replicas import replica_name
from protocol.torchrun import free_port
from service.proctree import end_tree


@dataclass
class Shape:
    """What every worker runs: how fast its groups step and heartbeat, and when to measure."""

    lighthouse: str
    step_s: float
    heartbeat_s: float
    quorum_timeout_s: float
    measure_from: float
    """wall-clock time the window opens: quorums asked before it are not counted"""
    measure_until: float
    kill_every_s: float
    rejoin_after_s: float


@dataclass
class WorkerResult:
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    kill_to_quorum: list[float] = field(default_factory=list)
    quorum_sizes: Counter = field(default_factory=Counter)
    """participants of each quorum id this worker's groups received (in the window)"""
    first_quorum: float | None = None
    """wall-clock time the last of this worker's groups had its first quorum"""


class ThinGroup:
    """One group's rank 0 as the Lighthouse sees it: a replica id, heartbeats, a quorum a step."""

    def __init__(self, group: int, shape: Shape, worker: "Worker"):
        from torchft._torchft import LighthouseClient

        self.group = group
        self.shape = shape
        self.worker = worker
        self.client = LighthouseClient(shape.lighthouse, timedelta(seconds=5))
        self.replica_id: str | None = None
        self.step = 0
        self._stop = threading.Event()

    def start(self) -> None:
        self.replica_id = f"{replica_name(self.group)}:{uuid.uuid4()}"
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(self.replica_id, self._stop), daemon=True).start()

    def kill(self) -> str:
        replica_id, self.replica_id = self.replica_id, None
        self._stop.set()
        return replica_id

    def _run(self, replica_id: str, stop: threading.Event) -> None:
        while not stop.is_set() and time.time() < self.shape.measure_until:
            asked, began = time.time(), time.monotonic()
            try:
                quorum = self.client.quorum(replica_id=replica_id, timeout=timedelta(seconds=self.shape.quorum_timeout_s),
                                            address="", store_address="", step=self.step, world_size=1,
                                            shrink_only=False)
            except Exception:  # a timeout: counted, asked again
                if not stop.is_set():
                    self.worker.failed(asked)
                continue
            if stop.is_set():
                break  # killed while it waited
            members = {m.replica_id: m.step for m in quorum.participants}
            self.worker.received(self.group, asked, time.monotonic() - began, int(quorum.quorum_id), members)
            self.step = max(members.values()) + 1
            stop.wait(self.shape.step_s)


class Worker:
    """Groups of one process: their threads, one heartbeat thread, and (worker 0) the kills."""

    def __init__(self, groups: list[int], shape: Shape, kills: bool):
        self.shape = shape
        self.result = WorkerResult()
        self.groups = {g: ThinGroup(g, shape, self) for g in groups}
        self.kills = kills
        self._lock = threading.Lock()
        self._waiting: list[tuple[str, float]] = []  # killed replicas not yet left out of a quorum
        self._started: set[int] = set()

    def received(self, group: int, asked: float, seconds: float, quorum_id: int, members: dict[str, int]) -> None:
        now = time.time()
        with self._lock:
            if group not in self._started:
                self._started.add(group)
                if len(self._started) == len(self.groups):
                    self.result.first_quorum = now
            for replica_id, killed_at in list(self._waiting):
                if replica_id not in members:
                    self._waiting.remove((replica_id, killed_at))
                    if killed_at >= self.shape.measure_from:
                        self.result.kill_to_quorum.append(now - killed_at)
            if asked >= self.shape.measure_from:
                self.result.latencies.append(seconds)
                self.result.quorum_sizes[quorum_id] = len(members)

    def failed(self, asked: float) -> None:
        with self._lock:
            if asked >= self.shape.measure_from:
                self.result.failed += 1

    def _heartbeats(self, client) -> None:
        while time.time() < self.shape.measure_until:
            for g in list(self.groups.values()):
                if (replica_id := g.replica_id) is not None:
                    try:
                        client.heartbeat(replica_id, timedelta(seconds=1))
                    except Exception:  # the Lighthouse slow: its next heartbeat may land
                        pass
            time.sleep(self.shape.heartbeat_s)

    def _kill_one_at_a_time(self) -> None:
        victims = sorted(self.groups)
        n = 0
        while time.time() + self.shape.kill_every_s < self.shape.measure_until:
            time.sleep(self.shape.kill_every_s)
            victim = self.groups[victims[n % len(victims)]]
            n += 1
            with self._lock:
                self._waiting.append((victim.kill(), time.time()))
            time.sleep(self.shape.rejoin_after_s)
            victim.start()

    def run(self) -> WorkerResult:
        from torchft._torchft import LighthouseClient

        for g in self.groups.values():
            g.start()
        threads = [threading.Thread(target=self._heartbeats, args=(LighthouseClient(self.shape.lighthouse,
                                                                                     timedelta(seconds=5)),),
                                    daemon=True)]
        if self.kills and self.shape.kill_every_s:
            threads.append(threading.Thread(target=self._kill_one_at_a_time, daemon=True))
        for t in threads:
            t.start()
        time.sleep(max(0.0, self.shape.measure_until - time.time()) + self.shape.step_s)
        with self._lock:
            return self.result


def run_worker(groups: list[int], shape: Shape, kills: bool, out) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RUST_LOG="warn")  # before torchft is imported: no line per client
    out.send(Worker(groups, shape, kills).run())
    out.close()


def start_lighthouse(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """torchft's own Lighthouse, alone, on a free port; and its address."""
    settings = LighthouseSettings(bind=f"127.0.0.1:{free_port()}", min_replicas=1,
                                  join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    with open(log, "ab") as out:
        proc = subprocess.Popen(settings.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RUST_LOG": "warn"})
    return proc, settings.local_url


PERF_LINE = re.compile(r"\s*(?P<share>[\d.]+)%\s+(?P<dso>\S+)\s+\[.\]\s+(?P<symbol>.+?)(?:\s+-\s+-)?\s*$")
"""A line of ``perf report --sort dso,symbol``: its share, shared object and symbol."""


def profile(pid: int, seconds: float, data: Path) -> list[tuple[float, str]]:
    """Where the Lighthouse's CPU went over ``seconds``: perf's samples of every thread (its
    tokio workers are not Python threads), the 30 functions with the largest share by
    themselves, highest first."""
    subprocess.run(["perf", "record", "-F", "199", "-p", str(pid), "-o", str(data), "--", "sleep", str(seconds)],
                   check=True, capture_output=True)
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso,symbol",
                             "--percent-limit", "0.5"], check=True, capture_output=True, text=True).stdout
    data.unlink()
    return [(float(m["share"]) / 100, f"{m['dso']} {m['symbol']}") for m in map(PERF_LINE.match, report.splitlines())
            if m][:30]


def measure(args: argparse.Namespace, groups: int) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"ftbench-lighthouse-{groups}-"))
    lighthouse, address = start_lighthouse(args, state / "lighthouse.log")
    procs: list[multiprocessing.Process] = []
    try:
        time.sleep(1.0)
        now = time.time()
        shape = Shape(address, args.step_s, args.heartbeat_s, args.quorum_timeout_s,
                      measure_from=now + args.settle_s, measure_until=now + args.settle_s + args.duration,
                      kill_every_s=args.kill_every, rejoin_after_s=args.rejoin_after_s)
        ctx = multiprocessing.get_context("spawn")
        pipes = []
        per = -(-groups // args.workers)
        for w in range(args.workers):
            mine = list(range(w * per, min(groups, (w + 1) * per)))
            if mine:
                receive, send = ctx.Pipe(duplex=False)
                procs.append(ctx.Process(target=run_worker, args=(mine, shape, w == 0, send), daemon=True))
                pipes.append(receive)
        for p in procs:
            p.start()
        lh = psutil.Process(lighthouse.pid)
        time.sleep(max(0.0, shape.measure_from - time.time()))
        cpu_before, clients_before = sum(lh.cpu_times()[:2]), sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)
        top = profile(lighthouse.pid, min(20.0, args.duration - 2), state / "lighthouse.perf") if args.profile else None
        time.sleep(max(0.0, shape.measure_until - time.time()))
        cpu_after, clients_after = sum(lh.cpu_times()[:2]), sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)
        results: list[WorkerResult] = [pipe.recv() for pipe in pipes]
    finally:
        for p in procs:
            if p.is_alive():
                end_tree(p.pid, signal.SIGKILL)
            p.join(5)
        end_tree(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait(10)
    quorums = {q: n for r in results for q, n in r.quorum_sizes.items()}
    started = [r.first_quorum for r in results]
    rounds = sum(len(r.latencies) for r in results) / groups
    return {
        "groups": groups, "all_started": all(s is not None and s <= shape.measure_from for s in started),
        "quorum_s": summary([s for r in results for s in r.latencies]), "failed": sum(r.failed for r in results),
        "kill_to_quorum_s": summary(results[0].kill_to_quorum), "rounds": rounds, "quorums": len(quorums),
        "quorum_members": {"min": min(quorums.values(), default=None), "max": max(quorums.values(), default=None)},
        "lighthouse_cores": (cpu_after - cpu_before) / args.duration,
        "lighthouse_core_s_per_round": (cpu_after - cpu_before) / rounds if rounds else None,
        "clients_cores": (clients_after - clients_before) / args.duration,
        "profile": [{"share": share, "frame": frame} for share, frame in top] if top else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--step-s", type=float, default=1.0, help="each group's compute between quorums")
    parser.add_argument("--workers", type=int, default=2, help="client processes the groups are spread over")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=10.0, help="before the window: every group starts")
    add_quorum_options(parser)
    parser.add_argument("--quorum-timeout-s", type=float, default=10.0)
    parser.add_argument("--profile", action="store_true", help="perf record on the Lighthouse in the window")
    args = parser.parse_args()
    os.environ["RUST_LOG"] = "warn"  # torchft's clients log a line each when they connect
    print(f"{'groups':>6} {'quorum ms':>12} {'failed':>6} {'kill→quorum s':>14} {'rounds':>7} {'quorums':>8} {'members':>9} "
          f"{'LH cores':>9} {'LH core-s/round':>16} {'clients':>8}", flush=True)
    runs = []
    for n in args.groups:
        r = measure(args, n)
        runs.append(r)
        k = r["kill_to_quorum_s"]
        kills = "-" if not k["n"] else f"{k['p50']:.2f}/{k['max']:.2f}"
        members = f"{r['quorum_members']['min']}-{r['quorum_members']['max']}"
        per = r["lighthouse_core_s_per_round"]
        print(f"{n:>6} {fmt(r['quorum_s']):>12} {r['failed']:>6} {kills:>14} {r['rounds']:>7.1f} {r['quorums']:>8} "
              f"{members:>9} {r['lighthouse_cores']:>9.2f} {per if per is None else round(per, 3)!s:>16} "
              f"{r['clients_cores']:>8.2f}{'' if r['all_started'] else '  (not every group started in time)'}",
              flush=True)
    print(f"wrote {write_result('lighthouse', vars(args), runs=runs)}")


if __name__ == "__main__":
    main()
