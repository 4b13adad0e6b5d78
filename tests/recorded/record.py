"""Records the event streams tests/test_timeline.py replays: real drills on a real `ftctl up`.

    python tests/recorded/record.py            # rewrites tests/recorded/*.json (minutes on 2 cores)

Each file holds one drill: the groups as the control plane saw them when it began, every event
the control plane received from a second before the kill to the end of the drill in arrival
order (the order a drill observes them in), and the drill's own report.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from bench.common import Up  # noqa: E402

SMALL = ["--seq-len=64", "--local-batch-size=1", "--fingerprint-every=5"]
RUNS = {
    "kill_heal_rejoined_by_drill": dict(groups=2, up={"auto_rejoin": False}, drill={"kind": "kill-heal", "group": 1}),
    "kill_heal_failover_to_spare": dict(groups=2, up={"spares": 2, "join_timeout_ms": 200},
                                        drill={"kind": "kill-heal", "group": 1}),
    "kill_heal_three_groups": dict(groups=3, up={"auto_rejoin": False}, drill={"kind": "kill-heal", "group": 0}),
    "chaos_two_groups": dict(groups=2, up={"auto_rejoin": False},
                             drill={"kind": "chaos", "mtbf_s": 6, "duration_s": 30, "seed": 1,
                                    "rejoin_delay_s": 1, "baseline_s": 6}),
}


def events_since(up: Up, after_id: int) -> list[dict]:
    out = []
    while page := up.control.events(after_id=after_id, limit=1000):
        out += page
        after_id = page[-1]["id"]
    return out


def stored_body(event: dict) -> dict:
    """The event as its rank, agent or control plane wrote it: without the API's id (and the rank
    the API lists as null for an event no rank wrote: a process, straggler or partition event)."""
    return {k: v for k, v in event.items() if k != "id" and not (k == "rank" and v is None)}


def record(name: str, groups: int, up_kwargs: dict, drill: dict) -> None:
    state = Path(tempfile.mkdtemp(prefix=f"ftrecord-{name}-")) / "state"
    up = Up(state, groups, 1 if groups > 2 else 2, SMALL, **up_kwargs)
    try:
        up.wait_training()
        if up_kwargs.get("spares"):
            up.wait_spares_ready(list(range(groups)))
        time.sleep(3)
        before = {g["group"]: {k: g[k] for k in ("state", "participants", "quorum_id")}
                  for g in up.control.groups()}
        last = up.control.events(since=time.time() - 1, limit=1)
        first_id = last[0]["id"] - 1 if last else 0
        report = up.drill(drill)
        time.sleep(2)
        events = events_since(up, first_id)
    finally:
        up.stop()
    (HERE / f"{name}.json").write_text(json.dumps(
        {"drill": report, "groups_before": before, "ranks_per_group": 1 if groups > 2 else 2,
         "events": [stored_body(e) for e in events]}) + "\n")
    print(f"{name}: {report['status']} with {len(events)} events", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or RUNS:
        run = RUNS[name]
        record(name, run["groups"], run["up"], run["drill"])
