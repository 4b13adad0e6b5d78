"""Synchronous HSDP across a slow link between groups, measured: the baseline that semi-synchronous
training (DiLoCo, LocalSGD: issue 34) has to beat.

    python -m bench.slow_link --link-mbit 10000 1000 100 [--steps 30] [--warmup 8]    # root: namespaces

Two groups (one rank each, the default model unless ``--seq-len`` / ``--local-batch-size`` say
otherwise) on hosts of their own (network namespaces, ``tests/netns.py``), the Lighthouse on a
third. For each rate a fresh job, each group host's link shaped to R Mbit/s (a token bucket on its
``eth0``: whatever crosses groups crosses two shaped links); once ``--warmup`` steps are
committed, the next ``--steps`` are measured from group 0's step events: tokens/s over both
groups, the median step, the median time a step waits on the other group (its cross-group
all-reduce and the gradient check's exchange), and the bytes the two hosts sent per step (their
``eth0`` counters: the gradients, the Lighthouse's and the managers' traffic besides).

Writes ``bench/results/slow-link-*.json``; docs/workloads.md reads its numbers from there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import write_result
from tests.cluster import committed_steps, groups_on_hosts, lighthouse_on_host, read_events, wait_for
from tests.netns import NamespaceHosts, why_unavailable
from tests.processes import Owner

GROUPS = 2


def measure(mbit: float, args) -> dict:
    """One job on links of ``mbit`` Mbit/s."""
    trainer = ["--groups", str(GROUPS), "--steps", "1000000", "--ranks-per-group", "1", "--log-every", "10",
               "--seq-len", str(args.seq_len), "--local-batch-size", str(args.local_batch_size)]
    with NamespaceHosts(1 + GROUPS) as net, Owner() as owner, tempfile.TemporaryDirectory(prefix="bench-link-") as tmp:
        for i in range(1, 1 + GROUPS):
            net.shape(i, mbit)
        lighthouse = lighthouse_on_host(net, 0, owner)
        events_dir = Path(tmp) / "events"
        groups = groups_on_hosts(net, GROUPS, ["--lighthouse", lighthouse, "--events-dir", str(events_dir), *trainer],
                                 Path(tmp), owner.env())
        try:
            def steps() -> list[dict]:
                return [e for e in committed_steps(read_events(events_dir, 0), 0) if e["participants"] == GROUPS]

            wait_for(lambda: len(steps()) >= args.warmup, 600, f"{args.warmup} steps at {mbit:g} Mbit/s")
            sent_before = sum(net.sent_bytes(i) for i in range(1, 1 + GROUPS))
            counted_from = len(steps())
            wait_for(lambda: len(steps()) >= counted_from + args.steps, 1800, f"{args.steps} steps at {mbit:g} Mbit/s")
            sent = sum(net.sent_bytes(i) for i in range(1, 1 + GROUPS)) - sent_before
            done = steps()
            window = done[counted_from - 1:counted_from + args.steps]
            measured = window[1:]
            seconds = window[-1]["ts"] - window[0]["ts"]
            counted_steps = len(done) - counted_from  # the bytes cover every step seen since
        finally:
            for g in groups:
                g.stop()
    tokens = sum(e["tokens"] for e in measured) * GROUPS  # every group trains as many tokens a step
    return {"link_mbit": mbit, "steps": len(measured), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "step_median_s": statistics.median(e["step_s"] for e in measured),
            "waiting_median_s": statistics.median(e["allreduce_s"] for e in measured),
            "bytes_per_step": sent / counted_steps,
            "loss_last": measured[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mbit", type=float, nargs="+", default=[10000, 1000, 100])
    parser.add_argument("--steps", type=int, default=30, help="steps measured per rate")
    parser.add_argument("--warmup", type=int, default=8, help="steps committed before the measured ones")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch-size", type=int, default=4)
    args = parser.parse_args()
    if why := why_unavailable():
        sys.exit(f"bench.slow_link needs network namespaces: {why}")
    runs = []
    for mbit in args.link_mbit:
        run = measure(mbit, args)
        runs.append(run)
        print(f"{mbit:>7g} Mbit/s  {run['tokens_per_s']:8.0f} tokens/s  step {run['step_median_s']:.2f} s, waiting on "
              f"the other group {run['waiting_median_s']:.2f} s  {run['bytes_per_step'] / 1e6:.1f} MB sent a step",
              flush=True)
    fastest = max(runs, key=lambda r: r["link_mbit"])
    for run in runs:
        run["throughput_vs_fastest_link"] = run["tokens_per_s"] / fastest["tokens_per_s"]
    out = write_result("slow-link", {"sync": "hsdp", "groups": GROUPS, "ranks_per_group": 1, "steps": args.steps,
                                     "warmup": args.warmup, "seq_len": args.seq_len,
                                     "local_batch_size": args.local_batch_size, "link_mbit": args.link_mbit},
                       runs=runs)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
