"""Steady-state cost of torchft: HSDP through torchft vs the same HSDP with a plain process group.

    python -m bench.overhead --steps 60

Same model, ranks, data and batch: `ftctl up` (G groups × K ranks, torchft Manager across
groups) against bench/classic_trainer.py (one torchrun job, FSDP2's 2-D mesh, no torchft).
Reports median step times, their ratio, and the per-step torchft costs (should_commit +
optimizer, and waiting on the cross-group all-reduce, which includes the async quorum).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.classic import ClassicJob
from bench.common import job_parser
from bench.step_time import measure


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
    parser.add_argument("--trainer-arg", action="append", default=[])
    args = parser.parse_args()
    ft = measure(args.groups, args.ranks_per_group, args.steps, args.warmup, args.trainer_arg)
    classic = classic_step_time(args.groups, args.ranks_per_group, args.steps, args.warmup, args.trainer_arg)
    print(f"{args.groups} groups × {args.ranks_per_group} ranks, {args.steps} steps after {args.warmup} warm-up, "
          f"trainer args {args.trainer_arg or 'default'}")
    print(f"  torchft HSDP step   {ft['step_s']:.3f} s (compute {ft['compute_s']:.3f}, all-reduce wait "
          f"{ft['allreduce_s']:.3f}, should_commit+optimizer {ft['commit_s']:.3f})")
    print(f"  plain HSDP step     {classic:.3f} s")
    print(f"  ratio               {ft['step_s'] / classic:.3f}  (torchft costs {100 * (ft['step_s'] / classic - 1):+.1f}%)")


if __name__ == "__main__":
    main()
