"""What grows with the number of groups, measured with simulated groups (``bench/simulated.py``).

    python -m bench.scale --groups 8 32 128 256 512 [--step-s 0.2] [--duration 30] [--kill-every 10]

For each group count N: the real torchft Lighthouse (under its wrapper), the real control plane
and N simulated groups over ``--hosts`` processes, each group registering itself, heartbeating
every ``--heartbeat-s`` and asking the Lighthouse for a quorum every step. Once all train, for
``--duration`` seconds, it reads the API and ``/metrics`` every ``--poll-s`` and kills a group
every ``--kill-every`` seconds through the REST API (and rejoins it ``--rejoin-after-s`` later).
It reports:

- quorum latency p50/p99 as the groups see it (request to answer), and failed requests;
- kill → the first quorum a surviving group receives without the killed replica;
- ingest lag p50/p99, from an event's timestamp to its row in SQLite;
- latency of ``GET /groups`` and ``/quorum``; size, series and time of ``/metrics``;
- time until Chromium shows every group on the page (``--no-page`` skips it);
- the CPU each process used (core-seconds per second of the window).

Writes bench/results/scale-*.json.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.common import TOKEN, write_result
from bench.simulated import SimJob, SimShape
from protocol import api
from service.client import ApiError
from service.proctree import process_tree

API_READS = {"groups": api.GROUPS, "quorum": api.QUORUM}
"""The reads the page makes every second, timed as raw requests (the answer's bytes, not parsed)."""


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": pct(values, 50), "p99": pct(values, 99), "max": max(values) if values else None}


def cpu_seconds(job: SimJob) -> dict[str, float]:
    """User + system CPU of each process of the job and its children, so far."""
    out = {}
    for name, proc in job.procs.items():
        total = 0.0
        for p in process_tree(proc.pid):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[name] = total
    return out


def cpu_cores(before: dict[str, float], after: dict[str, float], window_s: float) -> dict[str, float]:
    """Each process's CPU over the window, in cores (core-seconds per second)."""
    return {name: (after[name] - before.get(name, 0.0)) / window_s for name in after}


def series_count(exposition: bytes) -> int:
    """The samples in a ``/metrics`` body (every line that is not a comment)."""
    return sum(1 for line in exposition.decode().splitlines() if line and not line.startswith("#"))


def ingest_lag(db: Path, since: float) -> list[float]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return [row[0] for row in conn.execute("SELECT received - ts FROM events WHERE ts >= ?", (since,))]


def page_seconds(job: SimJob, groups: int) -> float:
    """From asking Chromium for the page to every group shown on it."""
    from bench.browser import chromium

    with chromium() as driver:
        began = time.perf_counter()
        driver.get(job.api_url)
        deadline = began + 60
        while time.perf_counter() < deadline:
            if driver.execute_script("return document.querySelectorAll('#groups > *').length") >= groups:
                return time.perf_counter() - began
            time.sleep(0.02)
    raise TimeoutError(f"the page did not show {groups} groups within 60 s")


def timed_get(job: SimJob, path: str) -> tuple[float, bytes]:
    began = time.perf_counter()
    response = job.api.get(path)
    response.raise_for_status()
    return time.perf_counter() - began, response.content


def measure(args: argparse.Namespace, groups: int) -> dict:
    # at least 4 groups a process: a kill is seen by the killed group's neighbours (bench/simulated.py)
    shape = SimShape(groups=groups, hosts=max(1, min(args.hosts, groups // 4)), step_s=args.step_s,
                     heartbeat_timeout_ms=args.heartbeat_timeout_ms, join_timeout_ms=args.join_timeout_ms,
                     heartbeat_s=args.heartbeat_s, forward_interval_s=args.forward_interval_s)
    state = Path(tempfile.mkdtemp(prefix=f"ftbench-scale-{groups}-"))
    with SimJob(state, shape, TOKEN, ["--max-groups", str(max(groups, 4096))]) as job:
        ready_s = job.wait_training(args.ready_timeout_s)
        time.sleep(args.settle_s)
        job.stats(reset=True)
        cpu_before, began, since = cpu_seconds(job), time.monotonic(), time.time()
        reads: dict[str, list[float]] = {name: [] for name in API_READS}
        metrics: list[tuple[float, int]] = []
        kills, rejoins = 0, []
        next_kill = began + args.kill_every if args.kill_every else float("inf")
        while (now := time.monotonic()) - began < args.duration:
            for name, path in API_READS.items():
                reads[name].append(timed_get(job, api.url(path))[0])
            seconds, body = timed_get(job, "/metrics")
            metrics.append((seconds, len(body)))
            if now >= next_kill:
                victim = 1 + (kills * 7) % (groups - 1)
                job.control.kill(victim)
                rejoins.append((now + args.rejoin_after_s, victim))
                kills, next_kill = kills + 1, next_kill + args.kill_every
            for due, victim in [r for r in rejoins if r[0] <= now]:
                job.control.rejoin(victim)
                rejoins.remove((due, victim))
            time.sleep(args.poll_s)
        window = time.monotonic() - began
        cpu_after = cpu_seconds(job)
        stats = job.stats()
        page_s = page_seconds(job, groups) if args.page else None
        lag = ingest_lag(state / "control.db", since)
    return {
        "groups": groups, "ready_s": ready_s, "window_s": window, "kills": kills,
        "quorum_s": summary(stats.quorum_s), "quorum_failures": stats.quorum_failures, "steps": stats.steps,
        "kill_to_reduced_quorum_s": summary(stats.kill_to_reduced_quorum_s),
        "ingest_lag_s": summary(lag),
        "api_groups_s": summary(reads["groups"]), "api_quorum_s": summary(reads["quorum"]),
        "metrics_s": summary([m[0] for m in metrics]), "metrics_bytes": metrics[-1][1] if metrics else None,
        "metrics_series": series_count(body), "page_s": page_s,
        "cpu_cores": cpu_cores(cpu_before, cpu_after, window),
    }


def measure_each(args: argparse.Namespace, measure, row) -> list[dict]:
    """``measure(args, n)`` for each of ``args.groups``, a line of ``row(result)`` and the CPU
    each; a count this machine cannot hold is a result too (its error)."""
    runs = []
    for n in args.groups:
        try:
            r = measure(args, n)
        except (TimeoutError, httpx.HTTPError, ApiError) as err:
            runs.append({"groups": n, "error": f"{type(err).__name__}: {err}"})
            print(f"{n:>6} failed: {runs[-1]['error']}", flush=True)
            continue
        runs.append(r)
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_cores"].items()))
        print(f"{n:>6} {row(r)}  {cpu}", flush=True)
    return runs


def fmt(s: dict, unit: float = 1000) -> str:
    return "-" if not s["n"] else f"{s['p50'] * unit:.0f}/{s['p99'] * unit:.0f}"


def add_quorum_options(parser: argparse.ArgumentParser) -> None:
    """How groups meet the Lighthouse and how often one is killed: the options the scale and
    Lighthouse benchmarks share."""
    parser.add_argument("--kill-every", type=float, default=10.0, help="0: no kills")
    parser.add_argument("--rejoin-after-s", type=float, default=3.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.1, help="torchft's Manager: 100 ms")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--join-timeout-ms", type=int, default=1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 32, 128, 256, 512])
    parser.add_argument("--hosts", type=int, default=4, help="processes the simulated groups are spread over")
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured, after every group trains")
    add_quorum_options(parser)
    parser.add_argument("--forward-interval-s", type=float, default=0.5, help="each agent's shipping interval")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--no-page", dest="page", action="store_false")
    args = parser.parse_args()
    print(f"{'groups':>6} {'quorum ms p50/p99':>18} {'kill→quorum s p50/max':>14} {'ingest lag ms':>14} "
          f"{'/groups ms':>11} {'/quorum ms':>11} {'/metrics':>16} {'page s':>7}  cpu cores")

    def row(r: dict) -> str:
        kill, page = r["kill_to_reduced_quorum_s"], r["page_s"]
        kill_text = "-" if not kill["n"] else f"{kill['p50']:.2f}/{kill['max']:.2f}"
        page_text = "-" if page is None else f"{page:.2f}"
        return (f"{fmt(r['quorum_s']):>18} {kill_text:>14} {fmt(r['ingest_lag_s']):>14} "
                f"{fmt(r['api_groups_s']):>11} {fmt(r['api_quorum_s']):>11} "
                f"{r['metrics_series']:>6} series {fmt(r['metrics_s'])} ms {page_text:>7}")

    runs = measure_each(args, measure, row)
    out = write_result("scale", vars(args), runs=runs)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
