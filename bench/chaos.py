"""Goodput under failures on a live job, and the ledger's projection from the measured recovery.

    python -m bench.chaos --mtbf 30 --duration 300 [--spares [--failover]] [--join-timeout-ms 200] \
        [--sync diloco --sync-every 20]

Starts `ftctl up`, runs one kill-heal drill (so GET /goodput has measured times), then
the chaos drill, and prints the chaos report and the ledger's answers at 1,024 and 16,384 GPUs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import Up, add_recovery_options, describe_recovery, job_parser, recovery_settings, write_result


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--mtbf", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rejoin-delay", type=float, default=5.0)
    parser.add_argument("--baseline", type=float, default=60.0)
    parser.add_argument("--sync", choices=["hsdp", "diloco", "localsgd"], default="hsdp",
                        help="how the groups train together (the trainer's --sync)")
    parser.add_argument("--sync-every", type=int, default=20, help="diloco, localsgd: inner steps between syncs")
    add_recovery_options(parser)
    args = parser.parse_args()
    up = Up(Path(tempfile.mkdtemp(prefix="ftbench-chaos-")) / "state", args.groups, args.ranks_per_group,
            ["--fingerprint-every=5", f"--sync={args.sync}",
             *([f"--sync-every={args.sync_every}"] if args.sync != "hsdp" else [])], **recovery_settings(args))
    try:
        up.wait_training()
        heal = up.drill({"kind": "kill-heal", "group": args.groups - 1})
        up.wait_training()
        time.sleep(15)  # the drill itself waits for the warm spares before its failure-free baseline
        chaos = up.drill({"kind": "chaos", "mtbf_s": args.mtbf, "duration_s": args.duration, "seed": args.seed,
                          "rejoin_delay_s": args.rejoin_delay, "baseline_s": args.baseline}, poll_s=1.0)
        goodput = up.control.goodput()
    finally:
        up.stop()
    out = write_result("chaos", {**vars(args), "recovery": describe_recovery(args)}, kill_heal=heal, chaos=chaos,
                       goodput=goodput)
    r = chaos["report"]
    print(f"chaos: {chaos['status']} {chaos.get('error') or ''}; mtbf {args.mtbf}s, {args.duration}s, seed {args.seed}, "
          f"drill rejoin after {args.rejoin_delay}s, {describe_recovery(args)}")
    print(f"  failure-free {r['baseline_rate']:.2f} samples/s, under chaos {r['chaos_rate']:.2f}: "
          f"goodput {100 * r['goodput']:.1f}% over {len(r['kills'])} kills")
    print("  time lost: " + ", ".join(f"{k} {v:.1f}s" for k, v in r["lost_s"].items()))
    print(f"  median step: {r['baseline_step_s']:.3f}s failure-free, {r['chaos_step_s']:.3f}s under chaos")
    for line in goodput["answer"]:
        print("  " + line)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
