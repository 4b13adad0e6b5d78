"""The corruption drill on live jobs: what the gradient check catches, and what it stops.

    python -m bench.sdc --repeats 2

One job with the check (the default) and a warm spare per group: ``--repeats`` transient drills
(one gradient element ×scale, once) on group 1, then ``--repeats`` persistent ones (every step)
on group 0, each waiting for the group's spare to be ready first. Then one job with
``--no-sdc-check`` and the same transient drill. Prints each drill's verdict, timings and each
group's largest applied gradient and update over its usual, and writes bench/results/sdc-*.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import REPO, Up, job_parser, spread, write_result

FIELDS = ("verdict", "action", "detect_s", "replace_s", "norms", "rerun_norm", "checker_norm", "applied_grad_ratio",
          "update_ratio", "loss_change", "fingerprints_equal")


def run_job(args, check: bool) -> list[dict]:
    state = Path(tempfile.mkdtemp(prefix="ftbench-sdc-")) / "state"
    trainer_args = ["--fingerprint-every=5", "--checkpoint-every=1000000", *([] if check else ["--no-sdc-check"])]
    up = Up(state, args.groups, args.ranks_per_group, trainer_args, spares=args.groups if check else 0)
    plan = [(1, False)] * args.repeats + ([(0, True)] * args.repeats if check else [])
    drills = []
    try:
        up.wait_training()
        for group, persistent in plan:
            if check:
                up.wait_spares_ready([group])
            up.wait_training()
            drill = up.drill({"kind": "corrupt", "group": group, "scale": args.scale, "persistent": persistent})
            r = drill["report"]
            drills.append(drill)
            print(f"check {'on ' if check else 'off'} group {group} {'persistent' if persistent else 'once      '} "
                  f"{drill['status']}: " + ", ".join(f"{k} {r.get(k)}" for k in FIELDS), flush=True)
    finally:
        up.stop()
    return drills


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1e4)
    args = parser.parse_args()
    on, off = run_job(args, True), run_job(args, False)
    reports = [d["report"] for d in on + off if d["status"] == "done"]
    by = lambda verdict: [r for r in reports if r.get("verdict") == verdict]  # noqa: E731
    print(f"\n{args.groups} groups × {args.ranks_per_group} ranks, ×{args.scale:g}, {args.repeats} repeat(s)")
    print(f"  transient: {len(by('transient'))}, verdict after {spread([r['detect_s'] for r in by('transient')])} s")
    print(f"  persistent: {len(by('persistent'))}, verdict after {spread([r['detect_s'] for r in by('persistent')])} s, "
          f"quarantine → spare's healed commit {spread([r['replace_s'] for r in by('persistent') if r['replace_s']])} s")
    applied = [r for r in reports if r.get("action") == "applied"]
    print(f"  check off: applied gradient / usual "
          f"{spread([v for r in applied for v in r['applied_grad_ratio'].values() if v])}, update / usual "
          f"{spread([v for r in applied for v in r['update_ratio'].values() if v])}")
    print(f"  fingerprints equal {sum(bool(r['fingerprints_equal']) for r in reports)}/{len(reports)}")
    out = write_result("sdc", vars(args), check_on=on, check_off=off)
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
