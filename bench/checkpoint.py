"""How long a checkpoint stalls the step: written off the step (dcp.async_save, the default)
against synchronous (``--no-checkpoint-async``), on the same job, in turns.

    python -m bench.checkpoint --saves 8 --every 5 --repeats 2

Each turn runs `ftctl up` (G groups × K ranks, the default model) until group 0 has published
``--saves`` checkpoints, then reads rank 0's checkpoint events: the stall (how long the step
waited) and the whole save; and the step time, median of the steps without a save, and mean
of every step with its stall (on a shared CPU the background write slows the steps it
overlaps). Writes bench/results/checkpoint-*.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Up, job_parser, spread, write_result


def turn(args, asynchronous: bool) -> dict:
    extra = [f"--checkpoint-every={args.every}", *([] if asynchronous else ["--no-checkpoint-async"])]
    # a group the watchdog ends comes back by itself (ftctl up's default) instead of stalling the turn
    up = Up(Path(tempfile.mkdtemp(prefix="ftbench-ckpt-")) / "state", args.groups, args.ranks_per_group, extra)
    try:
        up.wait_training()
        deadline = time.monotonic() + 300
        while True:
            saves = [e for e in up.control.events(group=0, type="checkpoint", limit=1000)
                     if e["rank"] == 0 and e["action"] == "saved"]
            if len(saves) >= args.saves or time.monotonic() > deadline:
                break
            time.sleep(1)
        steps = [e for e in up.control.events(group=0, type="step", limit=1000)
                 if e["rank"] == 0 and e["committed"] and e["step"] > args.every]
    finally:
        up.stop()
    plain = [e["step_s"] for e in steps if e["checkpoint_stall_s"] == 0]
    every = [e["step_s"] + e["checkpoint_stall_s"] for e in steps]
    return {"asynchronous": asynchronous, "stall_s": [e["stall_s"] for e in saves], "save_s": [e["seconds"] for e in saves],
            "step_s": statistics.median(plain) if plain else None,
            "mean_step_s": statistics.fmean(every) if every else None}


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--every", type=int, default=5, help="a checkpoint every N steps")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    turns = []
    for i in range(args.repeats):
        for asynchronous in (True, False):
            turns.append(turn(args, asynchronous))
            t = turns[-1]
            print(f"turn {i + 1} {'async' if asynchronous else 'sync '}: stall {spread(t['stall_s'])} s, "
                  f"save {spread(t['save_s'])} s, step {t['step_s']:.3f} s (without a save), "
                  f"{t['mean_step_s']:.3f} s (mean, saves and stalls included)", flush=True)

    def pooled(asynchronous: bool, key: str) -> list[float]:
        return [v for t in turns if t["asynchronous"] == asynchronous for v in t[key]]

    stall_async, stall_sync = statistics.median(pooled(True, "stall_s")), statistics.median(pooled(False, "stall_s"))
    out = write_result("checkpoint", vars(args), turns=turns, stall_async_s=stall_async, stall_sync_s=stall_sync,
                       ratio=stall_async / stall_sync)
    print(f"\ncheckpoint stall, {args.groups} groups × {args.ranks_per_group} ranks, debugmodel, every {args.every} steps")
    print(f"  off the step (async): {spread(pooled(True, 'stall_s'))} s; the whole save {spread(pooled(True, 'save_s'))} s")
    print(f"  synchronous:          {spread(pooled(False, 'stall_s'))} s")
    print(f"  δ async / sync: {100 * stall_async / stall_sync:.0f}%")
    for asynchronous in (True, False):
        means = [t["mean_step_s"] for t in turns if t["asynchronous"] == asynchronous]
        print(f"  mean step, {'async' if asynchronous else 'sync '}: {spread(means)} s (saves and stalls included)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
