"""The kill-heal drill repeated R times on a live `ftctl up` job; medians and spread.

    python -m bench.drill --repeats 5 --groups 2 --ranks-per-group 2

Prints the recovery terms and where the rejoin time goes (the rejoined ranks' startup split
from their `start` events), and writes JSON with every run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Up, job_parser, spread
from protocol import defaults


def run(args) -> dict:
    state = Path(tempfile.mkdtemp(prefix="ftbench-")) / "state"
    trainer_args = [f"--seq-len={args.seq_len}", f"--batch-size={args.batch_size}", "--fingerprint-every=5",
                    "--checkpoint-every=1000000"]
    up = Up(state, args.groups, args.ranks_per_group, trainer_args, args.heartbeat_timeout_ms)
    runs = []
    try:
        up.wait_training()
        for i in range(args.repeats):
            time.sleep(args.settle_s)
            drill = up.drill({"kind": "kill-heal", "group": args.group})
            r = drill["report"]
            starts = [e for e in up.api.get("/api/v1/events", params={
                "group": args.group, "type": "start", "since": r.get("rejoined_at") or 0, "limit": 100}).json()["events"]]
            runs.append({"drill": drill, "start_events": starts})
            print(f"run {i + 1}/{args.repeats}: {drill['status']} detect {r.get('detect_s')} "
                  f"resume {r.get('survivors_resume_s')} heal {r.get('rejoin_to_healed_commit_s')} "
                  f"lost {r.get('survivors_steps_lost')} equal {r.get('fingerprints_equal')}", flush=True)
    finally:
        up.stop()
    return {"settings": vars(args), "runs": runs}


def summarize(result: dict) -> None:
    done = [r for r in result["runs"] if r["drill"]["status"] == "done"]
    reports = [r["drill"]["report"] for r in done]

    def col(key):
        return [x[key] for x in reports if x.get(key) is not None]

    print(f"\nkill-heal drill, {len(done)}/{len(result['runs'])} done, settings {result['settings']}")
    print(f"  kill → quorum shrank (detect)      {spread(col('detect_s'))} s")
    print(f"  kill → survivors commit again      {spread(col('survivors_resume_s'))} s")
    print(f"  survivor steps lost                {spread(col('survivors_steps_lost'))}")
    print(f"  rejoin → healed commit             {spread(col('rejoin_to_healed_commit_s'))} s")
    print(f"  heal fetch (rank 0)                {spread(col('heal_fetch_s'))} s, "
          f"{statistics.median(col('heal_bytes')) / 2**20 if col('heal_bytes') else 0:.1f} MiB")
    print(f"  fingerprints equal                 {sum(bool(x['fingerprints_equal']) for x in reports)}/{len(reports)}")
    starts = [e for r in done for e in r["start_events"] if e["rank"] == 0]
    if starts:
        print("  where the rejoin time goes (rank 0 of the rejoined group, medians):")
        for key in ("imports_s", "process_group_s", "data_s", "model_s", "manager_s", "checkpoint_s"):
            print(f"    {key:<18} {statistics.median(e[key] for e in starts):.2f} s")


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=1, help="the group to kill")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=defaults.HEARTBEAT_TIMEOUT_MS)
    parser.add_argument("--settle-s", type=float, default=5.0, help="pause between drills")
    parser.add_argument("--out", type=Path, default=Path("bench-drill.json"))
    args = parser.parse_args()
    result = run(args)
    result["settings"] = {k: str(v) for k, v in result["settings"].items()}
    args.out.write_text(json.dumps(result, indent=2))
    summarize(result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
