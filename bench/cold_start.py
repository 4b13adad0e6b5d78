"""Cold starts: a killed group rejoining with nothing pre-started, and the rebuild of a warm spare.

    python -m bench.cold_start --repeats 5 [--no-zygote]

Phase 1 (no spares): the kill-heal drill R times on a live `ftctl up` job; the rejoin → healed
commit time and where it goes (the rejoined ranks' startup split from their `start` events).
Phase 2 (a warm spare per group): R times, promote group G's spare by a kill-heal drill, then
follow the agent's next spare from its launch to ready, summing the CPU time of its processes
(the torchrun tree, or the zygote's leader and ranks): the core-seconds every kill costs in
the background. With the zygote, its own one-time imports are reported apart.
Writes bench/results/cold-start-*.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import Up, job_parser, spread, write_result
from protocol.layout import GroupLayout
from protocol import defaults
from protocol.files import read_model
from protocol.zygote import READY_LINE
from service.agent.pidfile import PidRecord

SPLIT = ("imports_s", "process_group_s", "data_s", "model_s", "checkpoint_s", "manager_s")


def trainer_args(args) -> list[str]:
    return [f"--seq-len={args.seq_len}", f"--local-batch-size={args.local_batch_size}", "--fingerprint-every=5",
            "--checkpoint-every=1000000"]


def cold_rejoins(args) -> list[dict]:
    up = Up(Path(tempfile.mkdtemp(prefix="ftbench-cold-")) / "state", args.groups, args.ranks_per_group,
            trainer_args(args), args.heartbeat_timeout_ms, zygote=args.zygote)
    runs = []
    try:
        up.wait_training()
        for i in range(args.repeats):
            time.sleep(args.settle_s)
            drill = up.drill({"kind": "kill-heal", "group": args.group})
            r = drill["report"]
            starts = up.control.events(group=args.group, type="start", since=r.get("rejoined_at") or 0, limit=100)
            runs.append({"status": drill["status"], "report": r, "start_events": starts})
            print(f"cold rejoin {i + 1}/{args.repeats}: {drill['status']} rejoin → healed commit "
                  f"{r.get('rejoin_to_healed_commit_s')} s, fingerprints equal {r.get('fingerprints_equal')}", flush=True)
    finally:
        up.stop()
    return runs


def tree_cpu_s(root: psutil.Process, seen: dict[int, float]) -> None:
    """Record the CPU seconds of ``root`` and its descendants so far (processes that ended keep their last reading)."""
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            seen[proc.pid] = times.user + times.system
        except psutil.Error:
            pass


def spare_rebuilds(args) -> tuple[list[dict], float | None]:
    """Each: seconds from the spare's launch to ready, and the core-seconds its processes used."""
    state = Path(tempfile.mkdtemp(prefix="ftbench-spare-")) / "state"
    up = Up(state, args.groups, args.ranks_per_group, trainer_args(args), args.heartbeat_timeout_ms,
            spares=args.groups, zygote=args.zygote)
    pid_file = state / "run" / GroupLayout(args.group).spare_pid
    runs, zygote_ready_s = [], None
    try:
        up.wait_training()
        up.wait_spares_ready([args.group])
        if args.zygote:
            lines = [line for line in (state / "logs" / GroupLayout(args.group).log).read_text().splitlines()
                     if line.startswith(f"{READY_LINE} in ")]
            zygote_ready_s = float(lines[0].split()[3].rstrip("s")) if lines else None
        for i in range(args.repeats):
            time.sleep(args.settle_s)
            drill = up.drill({"kind": "kill-heal", "group": args.group})
            record = None
            deadline = time.monotonic() + 120
            while record is None and time.monotonic() < deadline:  # the agent launches the next spare after its delay
                record = read_model(pid_file, PidRecord)
                time.sleep(0.05)
            if record is None:
                raise TimeoutError("the agent started no new spare")
            root, seen = psutil.Process(record.pid), {}
            while up.control.agent_status(args.group)["spare"] != "ready":
                tree_cpu_s(root, seen)
                time.sleep(0.05)
            tree_cpu_s(root, seen)
            ready_s = time.time() - root.create_time()
            runs.append({"drill": drill["status"], "ready_s": ready_s, "core_s": sum(seen.values()),
                         "processes": len(seen)})
            print(f"spare rebuild {i + 1}/{args.repeats}: ready after {ready_s:.2f} s, "
                  f"{sum(seen.values()):.2f} core-seconds in {len(seen)} processes", flush=True)
    finally:
        up.stop()
    return runs, zygote_ready_s


def summarize(args, rejoins: list[dict], rebuilds: list[dict], zygote_ready_s: float | None) -> None:
    done = [r for r in rejoins if r["status"] == "done"]
    print(f"\ncold starts, {args.groups} groups × {args.ranks_per_group} ranks, debugmodel, seq {args.seq_len}, "
          f"batch {args.local_batch_size}/rank, starts {'forked by a zygote' if args.zygote else 'cold (torchrun)'}; medians")
    print(f"  rejoin → healed commit             {spread([r['report']['rejoin_to_healed_commit_s'] for r in done])} s "
          f"({len(done)}/{len(rejoins)} drills done)")
    print(f"  fingerprints equal                 {sum(bool(r['report'].get('fingerprints_equal')) for r in done)}/{len(done)}")
    starts = [e for r in done for e in r["start_events"] if e["rank"] == 0]
    if starts:
        print("  where the rejoin goes (rank 0 of the rejoined group):")
        for key in SPLIT:
            print(f"    {key:<18} {statistics.median(e[key] for e in starts):.2f} s")
    print(f"  spare rebuild: ready after         {spread([r['ready_s'] for r in rebuilds])} s")
    print(f"  spare rebuild: core-seconds        {spread([r['core_s'] for r in rebuilds])}")
    if zygote_ready_s is not None:
        print(f"  the zygote's own imports, once per agent: {zygote_ready_s:.1f} s")


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=1, help="the group to kill")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=defaults.HEARTBEAT_TIMEOUT_MS)
    parser.add_argument("--settle-s", type=float, default=5.0, help="pause between drills")
    parser.add_argument("--no-zygote", dest="zygote", action="store_false", help="cold torchrun starts (the baseline)")
    args = parser.parse_args()
    rejoins = cold_rejoins(args)
    rebuilds, zygote_ready_s = spare_rebuilds(args)
    out = write_result("cold-start", vars(args), rejoins=rejoins, spare_rebuilds=rebuilds,
                       zygote_ready_s=zygote_ready_s)
    summarize(args, rejoins, rebuilds, zygote_ready_s)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
