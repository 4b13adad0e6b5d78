"""A network cut, measured: how soon the survivors commit again, with the collective watch on
and off, side by side.

    python -m bench.partition --modes cut isolate --watch on off --repeats 4     # root: namespaces

Three groups (one rank each) on hosts of their own (network namespaces, ``tests/netns.py``), the
Lighthouse on a fourth; no agents and no control plane: what the trainers do alone. For each
watch setting (``--collective-watch`` / ``--no-collective-watch``, ``trainer/collective_watch.py``)
a fresh job; each repeat cuts (``cut``: the hosts of groups 1 and 2 stop reaching each other and
both still reach the rest; ``isolate``: group 2's host reaches nobody), waits for groups 0 and 1
to commit without group 2 (at most ``--give-up-s``), holds the cut ``--hold-s``, mends it and
waits for all three to commit together again. Each cut is classed ``inside`` or ``between`` by
where it fell in group 1's step: after the start of the wait of the step's cross-group
all-reduce, or before it (from group 1's step events: the wait ends just before the commit);
repeats alternate between aiming at one and at the other, from the timing of group 1's last steps.

Writes ``bench/results/partition-*.json``; the numbers in docs/faults.md and docs/multihost.md come
from there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from tests.cluster import groups_on_hosts, lighthouse_on_host, read_events, resumed_s, together, wait_for
from tests.netns import NamespaceHosts, why_unavailable
from tests.processes import Owner

TRAINER = ["--groups", "3", "--steps", "1000000", "--ranks-per-group", "1", "--seq-len", "64", "--local-batch-size",
           "2", "--log-every", "20", "--quorum-timeout-s", "120"]


def where_cut(events_dir: Path, cut_at: float) -> str | None:
    """``inside`` when the cut fell in the wait of group 1's cross-group all-reduce, ``between``
    when before it: group 1's first step whose wait ended after the cut (it ends just before the
    commit) tells."""
    steps = sorted((e for e in read_events(events_dir, 1) if e["type"] == "step" and e["rank"] == 0
                    and e["ts"] - e["commit_s"] > cut_at), key=lambda e: e["ts"])
    if not steps:
        return None
    step = steps[0]
    return "inside" if cut_at >= step["ts"] - step["commit_s"] - step["allreduce_s"] else "between"


def aim(events_dir: Path, where: str) -> float:
    """When to cut so that it lands ``inside`` the wait of group 1's next cross-group all-reduce
    (its middle) or ``between`` two (the middle of the compute before it), predicted from group
    1's last steps; where it really fell is read back afterwards (:func:`where_cut`)."""
    steps = sorted((e for e in read_events(events_dir, 1) if e["type"] == "step" and e["rank"] == 0
                    and e["committed"]), key=lambda e: e["ts"])[-6:]
    period = statistics.median(b["ts"] - a["ts"] for a, b in zip(steps, steps[1:]))
    last = steps[-1]
    wait_ends = last["ts"] - last["commit_s"]
    target = wait_ends - last["allreduce_s"] / 2 if where == "inside" else \
        wait_ends - last["allreduce_s"] - (period - last["allreduce_s"] - last["commit_s"]) / 2
    while target < time.time() + 0.05:
        target += period
    return target


def one_cut(net: NamespaceHosts, events_dir: Path, mode: str, aimed: str, args) -> dict:
    time.sleep(max(0.0, aim(events_dir, aimed) - time.time()))
    cut_at = time.time()
    net.cut(2, 3) if mode == "cut" else net.isolate(3)
    try:
        wait_for(lambda: together(events_dir, 2, cut_at, members=(0, 1)), args.give_up_s, "groups 0 and 1 alone")
        resumed = resumed_s(events_dir, cut_at)
    except AssertionError:
        resumed = None  # not within --give-up-s
    time.sleep(max(0.0, cut_at + args.hold_s - time.time()))
    mended_at = time.time()
    net.mend(2, 3) if mode == "cut" else net.reconnect(3)
    wait_for(lambda: together(events_dir, 3, mended_at), 300, "all three groups together again")
    back = min(e["ts"] for e in read_events(events_dir, 2) if e["type"] == "step" and e["rank"] == 0
               and e["committed"] and e["ts"] >= mended_at and e["participants"] == 3) - mended_at
    return {"mode": mode, "cut_at": cut_at, "aimed": aimed, "where": where_cut(events_dir, cut_at),
            "survivors_resume_s": resumed,
            "mended_to_back_s": back}


def job(watch: str, args) -> list[dict]:
    """A fresh job with the watch on or off; every cut of every mode, in turn."""
    runs = []
    with NamespaceHosts(4) as net, Owner() as owner, tempfile.TemporaryDirectory(prefix="bench-partition-") as tmp:
        lighthouse = lighthouse_on_host(net, 0, owner)
        events_dir = Path(tmp) / "events"
        flag = "--collective-watch" if watch == "on" else "--no-collective-watch"
        groups = groups_on_hosts(net, 3, ["--lighthouse", lighthouse, "--events-dir", str(events_dir), flag, *TRAINER],
                                 Path(tmp), owner.env())
        try:
            wait_for(lambda: together(events_dir, 5), 300, "three groups committing together")
            for repeat in range(args.repeats):
                for mode in args.modes:
                    aimed = ("inside", "between")[repeat % 2]
                    run = {"watch": watch, "repeat": repeat, **one_cut(net, events_dir, mode, aimed, args)}
                    print(f"watch {watch:3}  {mode:7}  {run['where'] or '?':7}  survivors resumed "
                          + (f"{run['survivors_resume_s']:.1f} s" if run["survivors_resume_s"] is not None
                             else f"not within {args.give_up_s:g} s")
                          + f", group 2 back {run['mended_to_back_s']:.1f} s after the mend", flush=True)
                    runs.append(run)
        finally:
            for g in groups:
                g.stop()
    return runs


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(r["watch"], r["mode"], r["where"]) for r in runs}, key=str):
        cell = [r for r in runs if (r["watch"], r["mode"], r["where"]) == key]
        resumed = [r["survivors_resume_s"] for r in cell if r["survivors_resume_s"] is not None]
        rows.append({"watch": key[0], "mode": key[1], "where": key[2], "cuts": len(cell),
                     "not_resumed": len(cell) - len(resumed),
                     "resume_median_s": statistics.median(resumed) if resumed else None,
                     "resume_max_s": max(resumed) if resumed else None,
                     "back_median_s": statistics.median(r["mended_to_back_s"] for r in cell)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=["cut", "isolate"], default=["cut", "isolate"])
    parser.add_argument("--watch", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--hold-s", type=float, default=6.0, help="how long each cut lasts")
    parser.add_argument("--give-up-s", type=float, default=30.0,
                        help="survivors not committing alone within this are recorded as not resumed")
    args = parser.parse_args()
    if why := why_unavailable():
        sys.exit(f"bench.partition needs network namespaces: {why}")
    runs = [run for watch in args.watch for run in job(watch, args)]
    rows = summary(runs)
    for row in rows:
        print(row)
    out = write_result("partition", {"modes": args.modes, "watch": args.watch, "repeats": args.repeats,
                                     "hold_s": args.hold_s, "give_up_s": args.give_up_s, "trainer": TRAINER},
                       runs=runs, summary=rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
