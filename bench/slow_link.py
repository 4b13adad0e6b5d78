"""Synchronous HSDP and semi-synchronous DiLoCo / LocalSGD across a slow link between groups, measured.

    python -m bench.slow_link --link-mbit 10000 1000 100 --sync hsdp diloco localsgd --sync-every 20   # root

Two groups (one rank each, the default model unless ``--seq-len`` / ``--local-batch-size`` say
otherwise) on hosts of their own (network namespaces, ``tests/netns.py``), the Lighthouse on a
third. For each rate a fresh job, each group host's link shaped to R Mbit/s (a token bucket on its
``eth0``: whatever crosses groups crosses two shaped links); once ``--warmup`` steps are
committed (by both groups: with DiLoCo / LocalSGD at a sync), the next ``--steps`` are
measured from group 0's events: tokens/s over both groups, the median (inner) step, the time a
step waits on the other group on average (``hsdp``: its cross-group all-reduce and the gradient
check's exchange; otherwise the syncs' time spread over the window's steps), the bytes the two
hosts sent per step (their ``eth0`` counters: gradients or pseudo-gradients, the Lighthouse's and
the managers' traffic besides), and the mean loss of both groups over the last ``--loss-steps``
steps: the same steps, so the same tokens, in every mode.

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


def marks(events: list[dict], sync: str) -> list[tuple[float, int]]:
    """(time, steps committed) at each point both groups' work is committed: every step with
    ``hsdp``, every sync of both groups otherwise (the window's steps commit with it)."""
    if sync == "hsdp":
        return [(e["ts"], e["step"]) for e in committed_steps(events, 0) if e["participants"] == GROUPS]
    return [(e["ts"], e["step"]) for e in events if e["type"] == "sync" and e["group"] == 0 and e["rank"] == 0
            and e["committed"] and e["members"] == GROUPS]


def measure(mbit: float, sync: str, seed: int, args) -> dict:
    """One job of ``sync`` on links of ``mbit`` Mbit/s."""
    trainer = ["--groups", str(GROUPS), "--steps", "1000000", "--ranks-per-group", "1", "--log-every", "10",
               "--seq-len", str(args.seq_len), "--local-batch-size", str(args.local_batch_size), "--sync", sync,
               "--seed", str(seed), *(["--sync-every", str(args.sync_every)] if sync != "hsdp" else [])]
    with NamespaceHosts(1 + GROUPS) as net, Owner() as owner, tempfile.TemporaryDirectory(prefix="bench-link-") as tmp:
        for i in range(1, 1 + GROUPS):
            net.shape(i, mbit)
        lighthouse = lighthouse_on_host(net, 0, owner)
        events_dir = Path(tmp) / "events"
        groups = groups_on_hosts(net, GROUPS, ["--lighthouse", lighthouse, "--events-dir", str(events_dir), *trainer],
                                 Path(tmp), owner.env())
        try:
            def reached(steps: int) -> tuple[float, int] | None:
                return next(((ts, step) for ts, step in marks(read_events(events_dir), sync) if step >= steps), None)

            wait_for(lambda: reached(args.warmup), 900, f"{args.warmup} steps of {sync} at {mbit:g} Mbit/s")
            sent_before = sum(net.sent_bytes(i) for i in range(1, 1 + GROUPS))
            first = reached(args.warmup)
            wait_for(lambda: reached(first[1] + args.steps), 1800, f"{args.steps} steps of {sync} at {mbit:g} Mbit/s")
            last = reached(first[1] + args.steps)
            sent = sum(net.sent_bytes(i) for i in range(1, 1 + GROUPS)) - sent_before
            counted_to = max(step for _, step in marks(read_events(events_dir), sync))  # the bytes cover these
        finally:
            for g in groups:
                g.stop()
        events = read_events(events_dir)
    steps = [e for e in committed_steps(events, 0) if first[1] < e["step"] <= last[1]]
    waits = (sum(e["allreduce_s"] for e in steps) if sync == "hsdp" else
             sum(e["seconds"] for e in events if e["type"] == "sync" and e["group"] == 0 and e["rank"] == 0
                 and e["committed"] and first[1] < e["step"] <= last[1]))
    at = args.warmup + args.steps  # the same step, so the same tokens, in every mode (the job went past it)
    tail = [e["loss"] for g in range(GROUPS) for e in committed_steps(events, g)
            if at - args.loss_steps < e["step"] <= at and e["loss"] is not None]
    seconds = last[0] - first[0]
    tokens = sum(e["step_samples"] for e in steps) * args.seq_len
    return {"sync": sync, "link_mbit": mbit, "seed": seed, "steps": last[1] - first[1], "seconds": seconds,
            "tokens_per_s": tokens / seconds, "step_median_s": statistics.median(e["step_s"] for e in steps),
            "waiting_per_step_s": waits / max(1, len(steps)),
            "bytes_per_step": sent / max(1, counted_to - first[1]),
            "loss_at_end": statistics.mean(tail), "loss_at_step": at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mbit", type=float, nargs="+", default=[10000, 1000, 100])
    parser.add_argument("--sync", nargs="+", default=["hsdp", "diloco", "localsgd"], choices=["hsdp", "diloco",
                                                                                              "localsgd"])
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps between syncs (diloco, localsgd)")
    parser.add_argument("--steps", type=int, default=60, help="steps measured per run (a multiple of --sync-every)")
    parser.add_argument("--warmup", type=int, default=20, help="steps committed before the measured ones")
    parser.add_argument("--loss-steps", type=int, default=20, help="the loss is the mean over the last N steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                        help="seeds run on the fastest link (the loss's spread); the other links run the first")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch-size", type=int, default=4)
    args = parser.parse_args()
    if why := why_unavailable():
        sys.exit(f"bench.slow_link needs network namespaces: {why}")
    fastest_link = max(args.link_mbit)
    runs = []
    for mbit in sorted(args.link_mbit, reverse=True):
        for sync in args.sync:
            for seed in args.seeds if mbit == fastest_link else args.seeds[:1]:
                run = measure(mbit, sync, seed, args)
                runs.append(run)
                print(f"{sync:>8} {mbit:>7g} Mbit/s seed {seed}  {run['tokens_per_s']:8.0f} tokens/s  step "
                      f"{run['step_median_s']:.2f} s, waiting on the other group {run['waiting_per_step_s']:.2f} s "
                      f"a step  {run['bytes_per_step'] / 1e6:.1f} MB sent a step  loss {run['loss_at_end']:.3f} at "
                      f"step {run['loss_at_step']}", flush=True)
    for run in runs:
        own = [r for r in runs if r["sync"] == run["sync"] and r["link_mbit"] == fastest_link]
        run["throughput_vs_fastest_link"] = run["tokens_per_s"] / statistics.mean(r["tokens_per_s"] for r in own)
    out = write_result("slow-link", {"groups": GROUPS, "ranks_per_group": 1, "steps": args.steps,
                                     "warmup": args.warmup, "sync_every": args.sync_every,
                                     "loss_steps": args.loss_steps, "seeds": args.seeds, "seq_len": args.seq_len,
                                     "local_batch_size": args.local_batch_size, "link_mbit": args.link_mbit},
                       runs=runs)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
