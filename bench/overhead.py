"""Steady-state cost of torchft and of the gradient check: HSDP through torchft with the check
on and off, against the same HSDP with a plain process group.

    python -m bench.overhead --steps 60 --repeats 2

Same model, ranks, data and batch: `ftctl up` (G groups × K ranks, torchft Manager across
groups) with the gradient check (the default) and with ``--no-sdc-check``, taken in turn
``--repeats`` times so that drift of this machine hits both alike, then
bench/classic_trainer.py (one torchrun job, FSDP2's 2-D mesh, no torchft). Reports median
step times, the check's share of the step, torchft's cost over plain HSDP, and the per-step
torchft costs (should_commit + optimizer; waiting on the cross-group collectives, which
includes the async quorum). Writes bench/results/overhead-*.json.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.classic import ClassicJob
from bench.common import REPO, job_parser, write_result
from bench.step_time import measure
from bench.workloads import WORKLOADS, workload_flags
from protocol import defaults


def classic_step_time(groups: int, ranks_per_group: int, steps: int, warmup: int, extra: list[str]) -> float:
    job = ClassicJob(Path(tempfile.mkdtemp(prefix="ftbench-overhead-")), groups, ranks_per_group, extra, max_restarts=0,
                     checkpoint_every=None)
    try:
        job.wait_step(warmup + steps)
        times = [e["step_s"] for e in job.events() if e["type"] == "step" and e["group"] == 0 and e["rank"] == 0
                 and warmup < e["step"] <= warmup + steps]
    finally:
        job.stop()
    return statistics.median(times)


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="check-on and check-off jobs, taken in turn")
    parser.add_argument("--workload", choices=list(WORKLOADS), help="bench/workloads.py's job (default: debugmodel)")
    parser.add_argument("--trainer-arg", action="append", default=[])
    parser.add_argument("--join-timeout-ms", type=int, default=defaults.JOIN_TIMEOUT_MS,
                        help="the Lighthouse's join timeout: longer than a step for a slow model")
    args = parser.parse_args()
    args.trainer_arg = [*workload_flags(args.workload), *args.trainer_arg]
    runs: dict[str, list[dict]] = {"check": [], "no_check": []}
    for _ in range(args.repeats):
        for name, flags in (("check", []), ("no_check", ["--no-sdc-check"])):
            runs[name].append(measure(args.groups, args.ranks_per_group, args.steps, args.warmup,
                                      [*args.trainer_arg, *flags], join_timeout_ms=args.join_timeout_ms))
            print(f"  {name:<9} step {runs[name][-1]['step_s']:.3f} s", flush=True)
    classic = classic_step_time(args.groups, args.ranks_per_group, args.steps, args.warmup, args.trainer_arg)
    on, off = (statistics.median(r["step_s"] for r in runs[name]) for name in ("check", "no_check"))
    share = on / off - 1
    ft = runs["check"][0]
    print(f"{args.groups} groups × {args.ranks_per_group} ranks, {args.steps} steps after {args.warmup} warm-up, "
          f"{args.repeats} repeat(s), trainer args {args.trainer_arg or 'default'}")
    print(f"  torchft HSDP step, check on    {on:.3f} s (compute {ft['compute_s']:.3f}, cross-group wait "
          f"{ft['allreduce_s']:.3f}, should_commit+optimizer {ft['commit_s']:.3f})")
    print(f"  torchft HSDP step, check off   {off:.3f} s")
    print(f"  the gradient check costs       {100 * share:+.1f}% of the step")
    print(f"  plain HSDP step                {classic:.3f} s")
    print(f"  torchft (check on) costs       {100 * (on / classic - 1):+.1f}% over plain HSDP")
    wait_share = statistics.median(r["allreduce_s"] / r["step_s"] for r in runs["check"])
    print(f"  waiting on the cross-group all-reduce: {100 * wait_share:.1f}% of the torchft step")
    out = write_result("overhead", vars(args), runs=runs, classic_step_s=classic, check_step_s=on,
                       no_check_step_s=off, check_share=share, allreduce_share=wait_share)
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
