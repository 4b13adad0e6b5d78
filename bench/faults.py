"""The detection matrix, measured: fault class × group count × victim.

    python -m bench.faults --groups 2 3 4 --faults kill hang lighthouse --repeats 3 [--ranks-per-group 1]

For each group count a fresh `ftctl up` (G groups × K ranks); for each fault class and each
victim (group 0 and the last group; the Lighthouse has no victim) the fault runs R times:
``kill``, ``hang``, ``drain`` and ``lighthouse`` through the kill-heal, hang, drain and Lighthouse
drills (a drain's row adds the survivors' longest step from the drain to their resume, as a
multiple of their median step before it). It prints, per
cell, the survivors' resume after the fault, the steps they lost and the time to
all groups training again (median and spread), and writes every report as JSON under
bench/results/ with the settings, core count and date.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import REPO, Up, add_recovery_options, describe_recovery, job_parser, recovery_settings, spread, write_result

FAULTS = ("kill", "hang", "drain", "lighthouse")


def drill_body(fault: str, victim: int | None) -> dict:
    return {"kill": {"kind": "kill-heal", "group": victim}, "hang": {"kind": "hang", "group": victim},
            "drain": {"kind": "drain", "group": victim, "reason": "bench.faults"},
            "lighthouse": {"kind": "lighthouse"}}[fault]


def survivor_step_ratio(up: Up, report: dict) -> float | None:
    """The survivors' longest rank-0 step from the fault to their resume, over their median step
    in the 20 s before it."""
    start, end = report.get("killed_at"), report.get("survivors_first_commit_at")
    if start is None or end is None:
        return None
    steps = [e for g in report["survivors"] for e in up.control.events(group=g, type="step", since=start - 20, limit=1000)
             if e["rank"] == 0 and e["committed"]]
    before = sorted(e["step_s"] for e in steps if e["ts"] < start)
    during = [e["step_s"] for e in steps if start <= e["ts"] <= end]
    return max(during) / before[len(before) // 2] if before and during else None


def as_row(fault: str, report: dict) -> dict:
    """The matrix's columns from a drill's report; the Lighthouse drill has no survivors, only
    groups that paused: its resume is the last group's first commit after the kill."""
    if fault != "lighthouse":
        return report
    resumed = [p["resumed_at"] for p in report.get("pauses", {}).values() if p.get("resumed_at") is not None]
    resume = max(resumed) - report["killed_at"] if resumed and report.get("killed_at") else None
    lost = [p["steps_lost"] for p in report.get("pauses", {}).values()]
    return {**report, "survivors_resume_s": resume, "kill_to_full_s": resume,
            "survivors_steps_lost": max(lost) if lost else None}


def cells(groups: int, faults: list[str]) -> list[tuple[str, int | None]]:
    victims = sorted({0, groups - 1})
    return [(f, v) for f in faults for v in ([None] if f == "lighthouse" else victims)]


def run_groups(args, groups: int) -> list[dict]:
    state = Path(tempfile.mkdtemp(prefix=f"ftbench-faults-{groups}-")) / "state"
    trainer_args = [f"--seq-len={args.seq_len}", f"--local-batch-size={args.local_batch_size}", "--fingerprint-every=5",
                    "--checkpoint-every=1000000"]
    up = Up(state, groups, args.ranks_per_group, trainer_args, **recovery_settings(args, groups))
    rows = []
    try:
        up.wait_training()
        for repeat in range(args.repeats):
            for fault, victim in cells(groups, args.faults):
                time.sleep(args.settle_s)
                if args.spares and victim is not None:
                    up.wait_spares_ready([victim])
                up.wait_training()
                drill = up.drill(drill_body(fault, victim), poll_s=0.3)
                r = as_row(fault, drill["report"])
                if fault == "drain":
                    r["survivor_step_ratio"] = survivor_step_ratio(up, r)
                rows.append({"groups": groups, "fault": fault, "victim": victim, "repeat": repeat,
                             "status": drill["status"], "error": drill.get("error"), "report": r})
                print(f"{groups} groups, {fault} of {victim if victim is not None else 'the Lighthouse'} "
                      f"#{repeat + 1}: {drill['status']} resume {r.get('survivors_resume_s')} "
                      f"lost {r.get('survivors_steps_lost')} full {r.get('kill_to_full_s')} "
                      f"{drill.get('error') or ''}", flush=True)
    finally:
        up.stop()
    return rows


def summarize(rows: list[dict]) -> None:
    print(f"\n{'groups':>6} {'fault':>10} {'victim':>6} {'survivors resume (s)':>34} {'steps lost':>26} "
          f"{'fault → all training (s)':>34} {'done':>5}")
    keys = sorted({(r["groups"], r["fault"], r["victim"] if r["victim"] is not None else -1) for r in rows})
    for groups, fault, victim in keys:
        cell = [r for r in rows if (r["groups"], r["fault"], r["victim"] if r["victim"] is not None else -1)
                == (groups, fault, victim)]
        done = [r["report"] for r in cell if r["status"] == "done"]

        def col(key: str) -> list[float]:
            return [x[key] for x in done if x.get(key) is not None]

        print(f"{groups:>6} {fault:>10} {victim if victim >= 0 else '-':>6} {spread(col('survivors_resume_s')):>34} "
              f"{spread(col('survivors_steps_lost')):>26} {spread(col('kill_to_full_s')):>34} "
              f"{len(done)}/{len(cell):>3}")


def main() -> None:
    parser = job_parser(__doc__, group_counts=True)
    parser.set_defaults(ranks_per_group=1)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause between drills")
    add_recovery_options(parser)
    args = parser.parse_args()
    rows = [row for groups in args.groups for row in run_groups(args, groups)]
    out = write_result("faults", {**vars(args), "recovery": describe_recovery(args)}, runs=rows)
    summarize(rows)
    print(f"\nwrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
