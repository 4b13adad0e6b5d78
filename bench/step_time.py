"""Median step time of 1 group × K ranks and G groups × K ranks with the default model.

    python -m bench.step_time --steps 40 [--starts forked torchrun] [--repeats 2]

Runs `ftctl up` for 1 group, then G groups, once for each way of starting the groups
(``--starts``: forked from the agents' zygotes, the default, or cold under torchrun), in turns
``--repeats`` times; reads the rank-0 step events through the API and reports medians of step,
compute and all-reduce time, skipping warm-up steps. Writes bench/results/step-time-*.json.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import Up, job_parser, write_result
from protocol import defaults


def measure(groups: int, ranks_per_group: int, steps: int, warmup: int, extra: list[str], zygote: bool = True,
            join_timeout_ms: int = defaults.JOIN_TIMEOUT_MS) -> dict:
    """Median step times of ``groups`` groups training together (a join timeout longer than a
    step keeps a slow model's groups in one quorum)."""
    state = Path(tempfile.mkdtemp(prefix="ftbench-")) / "state"
    up = Up(state, groups, ranks_per_group, ["--checkpoint-every=1000000", *extra], zygote=zygote,
            join_timeout_ms=join_timeout_ms)
    try:
        up.wait_training()
        events = up.full_quorum_steps(groups, warmup, steps, group=0)
    finally:
        up.stop()
    pick = lambda key: statistics.median(e[key] for e in events[:steps])  # noqa: E731
    return {"groups": groups, "ranks_per_group": ranks_per_group, "start": "forked" if zygote else "torchrun",
            "steps": len(events[:steps]), "step_s": pick("step_s"),
            "compute_s": pick("compute_s"), "allreduce_s": pick("allreduce_s"), "commit_s": pick("commit_s")}


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trainer-arg", action="append", default=[])
    parser.add_argument("--starts", nargs="+", choices=["forked", "torchrun"], default=["forked"])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        for start in args.starts:
            for groups in (1, args.groups):
                r = measure(groups, args.ranks_per_group, args.steps, args.warmup, args.trainer_arg, start == "forked")
                runs.append(r)
                print(f"{r['groups']} group(s) × {r['ranks_per_group']} ranks, {r['start']}, {r['steps']} steps: "
                      f"step {r['step_s']:.3f} s (compute {r['compute_s']:.3f}, all-reduce wait {r['allreduce_s']:.3f}, "
                      f"commit+optimizer {r['commit_s']:.3f})", flush=True)
    print(f"wrote {write_result('step-time', vars(args), runs=runs)}")


if __name__ == "__main__":
    main()
