"""The Grafana "Quorum" dashboard of a fault-tolerant HSDP job.

    python -m dashboards.quorum            # rewrite dashboards/quorum.json
    python -m dashboards.quorum --check    # exit 1 if the committed JSON is stale

Panel ids and query refIds are explicit so the JSON is stable and diffs stay readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

OUTPUT = Path(__file__).with_name("quorum.json")
DS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
G = 'group=~"$group"'
# ftctl_group_state_code: the state machine's states as numbers, for the state timeline
STATE_CODES = {"0": ("unknown", "gray"), "1": ("starting", "blue"), "2": ("joining", "purple"),
               "3": ("healing", "orange"), "4": ("training", "green"), "5": ("down", "red")}


def query(ref: str, expr: str, legend: str = "") -> prometheus.Dataquery:
    q = prometheus.Dataquery().ref_id(ref).expr(expr).datasource(DS)
    return q.legend_format(legend) if legend else q


def place(panel, pid: int, x: int, y: int, w: int, h: int, title: str, description: str):
    return (panel.id(pid).title(title).description(description).datasource(DS)
            .grid_pos(model.GridPos(x=x, y=y, w=w, h=h)))


def annotation(name: str, color: str, expr: str) -> db.AnnotationQuery:
    return db.AnnotationQuery().name(name).datasource(DS).enable(True).icon_color(color).expr(expr)


def panels() -> list:
    state_map = model.ValueMap(options={code: model.ValueMappingResult(text=name, color=color)
                                        for code, (name, color) in STATE_CODES.items()})
    return [
        place(stat.Panel(), 1, 0, 0, 4, 6, "Quorum id", "The Lighthouse's current quorum id; it moves on every membership change.")
        .with_target(query("A", "ftctl_lighthouse_quorum_id")),
        place(timeseries.Panel(), 2, 4, 0, 10, 6, "Participants, heartbeating, min_replicas",
              "Groups in the quorum against groups alive and the floor below which nothing commits.")
        .with_target(query("A", "ftctl_lighthouse_quorum_participants", "participants"))
        .with_target(query("B", "ftctl_lighthouse_heartbeating_replicas", "heartbeating"))
        .with_target(query("C", "ftctl_lighthouse_min_replicas", "min_replicas")).min(0),
        place(statetimeline.Panel(), 3, 14, 0, 10, 6, "Group state",
              "starting → joining → healing → training; down when killed, crashed or stopped.")
        .with_target(query("A", f"ftctl_group_state_code{{{G}}}", "group {{group}}")).mappings([state_map]),
        place(timeseries.Panel(), 4, 0, 6, 12, 7, "Step per group", "Last committed step of each group.")
        .with_target(query("A", f"ftctl_group_step{{{G}}}", "group {{group}}")),
        place(timeseries.Panel(), 5, 12, 6, 12, 7, "Lag behind the leader", "Steps each group is behind the most advanced one.")
        .with_target(query("A", f"ftctl_group_step_lag{{{G}}}", "group {{group}}")).min(0),
        place(timeseries.Panel(), 6, 0, 13, 12, 7, "Step time: compute vs waiting on the cross-group all-reduce",
              "The straggler view: one group's compute far above the others' makes everyone wait.")
        .with_target(query("A", f"sum by (group) (rate(ftctl_step_compute_seconds_sum{{{G}}}[1m])) / "
                                f"sum by (group) (rate(ftctl_step_compute_seconds_count{{{G}}}[1m]))", "compute g{{group}}"))
        .with_target(query("B", f"sum by (group) (rate(ftctl_step_allreduce_wait_seconds_sum{{{G}}}[1m])) / "
                                f"sum by (group) (rate(ftctl_step_allreduce_wait_seconds_count{{{G}}}[1m]))",
                           "all-reduce wait g{{group}}"))
        .unit("s"),
        place(timeseries.Panel(), 7, 12, 13, 12, 7, "Loss", "Last committed training loss of each group.")
        .with_target(query("A", f"ftctl_group_loss{{{G}}}", "group {{group}}")),
        place(timeseries.Panel(), 8, 0, 20, 8, 7, "Heals", "Heals from a live peer (5-minute increase) and their p90 duration.")
        .with_target(query("A", f"sum by (group) (increase(ftctl_heals_total{{{G}}}[5m]))", "heals g{{group}}"))
        .with_target(query("B", "histogram_quantile(0.9, sum by (le) (rate(ftctl_heal_duration_seconds_bucket[5m])))",
                           "p90 seconds, every group")),
        place(timeseries.Panel(), 9, 8, 20, 8, 7, "Failed commits", "Steps that could not commit (5-minute increase).")
        .with_target(query("A", f"sum by (group) (increase(ftctl_commit_failures_total{{{G}}}[5m]))", "group {{group}}")).min(0),
        place(timeseries.Panel(), 10, 16, 20, 8, 7, "Heartbeat age", "Seconds since each group's manager last heartbeated the Lighthouse.")
        .with_target(query("A", "ftctl_lighthouse_heartbeat_age_seconds", "group {{group}}")).unit("s"),
        place(stat.Panel(), 11, 0, 27, 8, 6, "Last kill-heal drill",
              "Kill → quorum shrank (detect), kill → survivors commit again, rejoin → healed commit.")
        .with_target(query("A", "ftctl_drill_seconds", "{{phase}}"))
        .with_target(query("B", "ftctl_drill_fingerprints_equal", "fingerprints equal")).unit("s"),
        place(stat.Panel(), 12, 8, 27, 8, 6, "Goodput",
              "Measured by the last chaos drill, and projected to 1,024 and 16,384 GPUs by the ledger.")
        .with_target(query("A", "ftctl_goodput_ratio", "chaos drill"))
        .with_target(query("B", "ftctl_goodput_projected_ratio", "{{path}} at {{gpus}} GPUs")).unit("percentunit"),
        place(timeseries.Panel(), 13, 16, 27, 8, 6, "Checkpoints and events",
              "Age of the newest checkpoint; events received and dropped by agents.")
        .with_target(query("A", "time() - ftctl_checkpoint_last_save_timestamp_seconds", "checkpoint age (s)"))
        .with_target(query("B", "rate(ftctl_events_received_total[1m])", "events/s"))
        .with_target(query("C", "increase(ftctl_events_dropped_total[5m])", "dropped in 5 min g{{group}}")),
        place(stat.Panel(), 14, 0, 33, 24, 5, "Detection and recovery by fault class",
              "The last drill of each class: fault → detected, and fault → the others commit again (a crash: "
              "kill-heal; a hang: the watchdog ends the group; the Lighthouse: the longest pause in commits).")
        .with_target(query("A", "ftctl_fault_detect_seconds", "{{fault}}: detected"))
        .with_target(query("B", "ftctl_fault_resume_seconds", "{{fault}}: trains again")).unit("s"),
        place(timeseries.Panel(), 15, 0, 38, 24, 6, "Stragglers",
              "The detector's view (GET /stragglers): each group's median compute over its peers' median, "
              "and 1 while a group is flagged as a persistent straggler.")
        .with_target(query("A", f"ftctl_straggler_slowdown_ratio{{{G}}}", "slowdown g{{group}}"))
        .with_target(query("B", f"ftctl_straggler{{{G}}}", "flagged g{{group}}")).min(0),
        place(timeseries.Panel(), 16, 0, 44, 24, 6, "Gradient check",
              "Each group's own gradient norm before it crosses groups, and the gradient check's incidents "
              "(10-minute increase, by verdict): each skipped the step in every group.")
        .with_target(query("A", f"ftctl_gradient_norm{{{G}}}", "norm g{{group}}"))
        .with_target(query("B", f"sum by (group, verdict) (increase(ftctl_sdc_incidents_total{{{G}}}[10m]))",
                           "{{verdict}} g{{group}}")).min(0),
        place(timeseries.Panel(), 17, 0, 50, 24, 6, "Data: samples trained",
              "Samples of the job's global order the committed steps trained, per second (the job's goodput in "
              "samples; × the sequence length: tokens), and those skipped (a missing group's share with "
              "--batch-policy shrink) or trained twice (never, unless something is wrong), 10-minute increase.")
        .with_target(query("A", 'rate(ftctl_samples_total{outcome="trained_once"}[1m])', "trained per second"))
        .with_target(query("B", 'increase(ftctl_samples_total{outcome=~"skipped|trained_twice"}[10m])',
                           "{{outcome}}")).min(0),
    ]


def build() -> db.Dashboard:
    dash = (
        db.Dashboard("Quorum").uid("ftctl-quorum").tags(["ftctl", "torchft", "hsdp"])
        .editable().refresh("5s").time("now-30m", "now")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(db.QueryVariable("group").label("Group").datasource(DS)
                       .query("label_values(ftctl_group_up, group)").multi(True).include_all(True).all_value(".*")
                       .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED))
        .annotation(annotation("Kills", "red", 'sum(increase(ftctl_group_exits_total{reason="killed"}[30s])) > 0'))
        .annotation(annotation("Rejoins", "blue", "sum(increase(ftctl_group_starts_total[30s])) > 0"))
        .annotation(annotation("Heals", "orange", "sum(increase(ftctl_heals_total[30s])) > 0"))
        .annotation(annotation("Gradient check", "purple", "sum(increase(ftctl_sdc_incidents_total[30s])) > 0"))
    )
    for panel in panels():
        dash = dash.with_panel(panel)
    return dash


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def panel_queries(dashboard_json: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every panel target, for tests and tooling."""
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard_json["panels"] for t in p.get("targets", [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON differs from the code")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python -m dashboards.quorum", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({len(json.loads(text)['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
