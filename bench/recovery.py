"""This service's recovery against the classic path, side by side, on the same job.

    python -m bench.recovery --repeats 3 [--spares [--failover]] [--join-timeout-ms 200] [--workload NAME]

torchft path (`ftctl up`, G groups × K ranks): the kill-heal drill R times: kill → survivors'
next commit, survivor steps lost, rejoin → healed commit phase by phase, heal bytes, and kill →
all groups training again. The drill rejoins the group as soon as the survivors commit; with --failover
the agents restart a killed group at once (`ftctl up`'s default; without it `--no-auto-rejoin`), which with a warm spare
promotes it into the survivors' next quorum: a join timeout shorter than the heartbeat
timeout lets that quorum form before the dead group's heartbeat expires.

Classic path (bench/classic_trainer.py: one torchrun job of G·K ranks, HSDP through FSDP2's
2-D mesh, DCP checkpoint every C steps, --max-restarts): SIGKILL one rank R times; kill → the
first step after the restart, and the steps redone from the last checkpoint.
Prints a table with medians and the ratios, and writes JSON.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.classic import ClassicJob
from bench.common import (
    Up,
    add_recovery_options,
    describe_recovery,
    job_parser,
    recovery_settings,
    spread,
    write_result,
)
from bench.workloads import WORKLOADS, workload_flags


def torchft_runs(args, trainer_args: list[str]) -> list[dict]:
    state = Path(tempfile.mkdtemp(prefix="ftbench-")) / "state"
    up = Up(state, args.groups, args.ranks_per_group, [*trainer_args, "--fingerprint-every=5"], **recovery_settings(args))
    runs = []
    try:
        up.wait_training()
        victim = args.groups - 1
        for i in range(args.repeats):
            time.sleep(args.settle_s)
            if args.spares:
                up.wait_spares_ready([victim])  # measure promotion of a ready spare, as between failures in production
            drill = up.drill({"kind": "kill-heal", "group": victim}, poll_s=0.3)
            r = drill["report"]
            if drill["status"] == "done":
                runs.append({"survivors_resume_s": r["survivors_resume_s"], "steps_lost": r["survivors_steps_lost"],
                             "rejoin_to_healed_commit_s": r["rejoin_to_healed_commit_s"],
                             "kill_to_full_s": r["kill_to_full_s"], "heal_bytes": r["heal_bytes"],
                             "detect_s": r["detect_s"], "fingerprints_equal": r["fingerprints_equal"],
                             "recovery": r["recovery"]})
            print(f"torchft run {i + 1}: {drill['status']} {runs[-1] if runs else drill.get('error')}", flush=True)
    finally:
        up.stop()
    return runs


def classic_runs(args, trainer_args: list[str]) -> list[dict]:
    job = ClassicJob(Path(tempfile.mkdtemp(prefix="ftbench-classic-")), args.groups, args.ranks_per_group, trainer_args,
                     max_restarts=args.repeats + 1, checkpoint_every=args.checkpoint_every)
    runs = []
    try:
        for i in range(args.repeats):
            job.wait_step(job.last_step() + args.checkpoint_every + args.checkpoint_every // 2)
            before = job.last_step()
            killed_at = job.kill_one_rank()
            deadline = time.monotonic() + 600
            while True:
                after = [e for e in job.events() if e["ts"] > killed_at and e["group"] == 0 and e["rank"] == 0]
                starts = [e for e in after if e["type"] == "start"]
                steps = [e for e in after if e["type"] == "step" and starts and e["ts"] > starts[0]["ts"]]
                if steps:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the classic job did not come back")
                time.sleep(0.2)
            resumed = starts[0]["resumed_step"]
            runs.append({"kill_to_full_s": steps[0]["ts"] - killed_at, "steps_redone": before - resumed,
                         "restart_split": {k: starts[0][k] for k in ("imports_s", "process_group_s", "data_s",
                                                                       "model_s", "checkpoint_s")}})
            print(f"classic run {i + 1}: {runs[-1]}", flush=True)
        saves = [e["seconds"] for e in job.events() if e["type"] == "checkpoint" and e["action"] == "saved"
                 and e["group"] == 0 and e["rank"] == 0]
        for r in runs:
            r["checkpoint_save_s"] = statistics.median(saves) if saves else None
    finally:
        job.stop()
    return runs


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="classic path: DCP checkpoint interval C")
    add_recovery_options(parser)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--paths", default="torchft,classic", help="which paths to run (comma-separated)")
    parser.add_argument("--workload", choices=list(WORKLOADS), help="bench/workloads.py's job (default: debugmodel)")
    parser.add_argument("--trainer-arg", action="append", default=[], help="more trainer flags")
    args = parser.parse_args()
    trainer_args = [*workload_flags(args.workload), f"--seq-len={args.seq_len}",
                    f"--local-batch-size={args.local_batch_size}", *args.trainer_arg]
    paths = set(args.paths.split(","))
    ft = torchft_runs(args, [*trainer_args, "--checkpoint-every=1000000"]) if "torchft" in paths else []
    classic = classic_runs(args, trainer_args) if "classic" in paths else []
    out = write_result("recovery", {**vars(args), "recovery": describe_recovery(args)}, torchft=ft, classic=classic)

    def col(rows, key):
        return [r[key] for r in rows if r.get(key) is not None]

    print(f"\nrecovery, {args.groups} groups × {args.ranks_per_group} ranks, {args.workload or 'debugmodel'}, "
          f"seq {args.seq_len}, "
          f"batch {args.local_batch_size}/rank, {describe_recovery(args)}; medians")
    print(f"{'':38} {'this service':>34} {'classic (torchrun restart)':>34}")
    print(f"{'kill → survivors commit again (s)':38} {spread(col(ft, 'survivors_resume_s')):>34} {'(all ranks restart)':>34}")
    print(f"{'rejoin → healed commit (s)':38} {spread(col(ft, 'rejoin_to_healed_commit_s')):>34} {'-':>34}")
    print(f"{'kill → all groups training (s)':38} {spread(col(ft, 'kill_to_full_s')):>34} {spread(col(classic, 'kill_to_full_s')):>34}")
    print(f"{'steps lost / redone':38} {spread(col(ft, 'steps_lost')):>34} {spread(col(classic, 'steps_redone')):>34}")
    if col(ft, "kill_to_full_s") and col(classic, "kill_to_full_s"):
        ratio = statistics.median(col(classic, "kill_to_full_s")) / statistics.median(col(ft, "kill_to_full_s"))
        resume = statistics.median(col(classic, "kill_to_full_s")) / statistics.median(col(ft, "survivors_resume_s"))
        print(f"classic / this service: to full group count {ratio:.1f}×; to training again (survivors) {resume:.1f}×")
    if col(ft, "steps_lost") and col(classic, "steps_redone"):
        steps = statistics.median(col(classic, "steps_redone")) / max(statistics.median(col(ft, "steps_lost")), 1)
        print(f"classic / this service: steps lost {steps:.1f}× (classic checkpoints every {args.checkpoint_every} steps)")
    for phase in (ft[0]["recovery"] if ft else []):
        seconds = [next(p["seconds"] for p in r["recovery"] if p["phase"] == phase["phase"]) for r in ft
                   if any(p["phase"] == phase["phase"] for p in r["recovery"])]
        print(f"  {('  ' if phase['within'] else '') + phase['label']:36} {spread(seconds):>34}  {phase['detail'] or ''}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
