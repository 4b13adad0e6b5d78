"""Terminal views of the cluster (rich)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"training": "bold green", "healing": "bold yellow", "joining": "cyan", "starting": "cyan",
               "down": "bold red", "unknown": "dim"}


SDC_SHOWN_S = 600.0
"""A group's latest gradient-check incident stays in its row this long."""


def _age(ts: float | None) -> str:
    if ts is None:
        return "-"
    seconds = max(0.0, time.time() - ts)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def groups_table(groups: list[dict]) -> Table:
    table = Table(expand=True, header_style="bold")
    for name in ("group", "state", "for", "step", "loss", "s/step", "groups", "quorum", "restarts", "last heal"):
        table.add_column(name, justify="left" if name in ("state", "last heal") else "right",
                         no_wrap=True, overflow="ellipsis")
    for g in groups:
        state = g["state"] + (f" ({g['down_reason']})" if g.get("down_reason") else "")
        if g.get("straggler"):
            state += f" · straggler ×{g['straggler']['slowdown']:.2f}"
        sdc = g.get("last_sdc")
        if sdc and time.time() - sdc["ts"] < SDC_SHOWN_S:
            state += f" · SDC {sdc['verdict']} @{sdc['step']}"
        heal = g.get("last_heal")
        heal_text = (f"@{heal['step']} ← g{heal['source_group']} {heal['bytes'] / 2**20:.0f} MiB "
                     f"{heal['fetch_s']:.1f}s, {_age(heal['ts'])} ago") if heal else "-"
        table.add_row(
            str(g["group"]), Text(state, style=STATE_STYLE.get(g["state"], "")), _age(g.get("since")),
            str(g["step"] if g["step"] is not None else "-"),
            Text("NaN", style="bold red") if g.get("diverged") else f"{g['loss']:.3f}" if g.get("loss") is not None else "-",
            f"{g['step_s']:.2f}" if g.get("step_s") is not None else "-",
            str(g["participants"] if g.get("participants") is not None else "-"),
            str(g["quorum_id"] if g.get("quorum_id") is not None else "-"), str(g.get("restarts", 0)), heal_text,
        )
    return table


def why_down(groups: list[dict]) -> list[Text]:
    """A line for each down group its agent said why of (a crash's last error line)."""
    return [Text(f"group {g['group']} {g['down_reason']}: {g['down_detail']}", style="red")
            for g in groups if g.get("down_detail")]


def data_line(data: dict | None) -> Text | None:
    """The job's data and what its committed steps trained of it (``GET /api/v1/data``)."""
    if not data or not data.get("job"):
        return None
    job = data["job"]
    epochs = f", {data['epochs']:.3g} epochs" if data.get("epochs") is not None else ""
    line = Text(f"{job['config']} ({job['dtype']}) on {job['dataset']}: batch {job['global_batch_size']} × "
                f"{job['seq_len']} tokens, {job['batch_policy']}  ·  samples {data['samples_planned']:,}{epochs}: ")
    line.append(f"{data['trained_once']:,} once", style="green")
    line.append(f", {data['trained_twice']:,} twice", style="bold red" if data["trained_twice"] else "")
    line.append(f", {data['skipped']:,} skipped", style="yellow" if data["skipped"] else "")
    return line


def cluster_view(quorum: dict, header: str = "", data: dict | None = None) -> Panel:
    if quorum.get("lighthouse_reachable"):
        beating = quorum.get("heartbeating")
        top = (f"quorum [bold]{quorum['quorum_id']}[/]  ·  members "
               f"{', '.join('g' + str(m['group']) for m in quorum['members']) or 'none'}  ·  "
               f"{beating if beating is not None else '?'} heartbeating")
    else:
        top = f"[red]Lighthouse unreachable:[/] {escape(str(quorum.get('lighthouse_error')))}"
    parts = [Text.from_markup(header)] if header else []
    data_text = data_line(data)
    return Panel(Group(*parts, Text.from_markup(top), *([data_text] if data_text else []), groups_table(quorum["groups"]),
                       *why_down(quorum["groups"])),
                 title="ftctl · elastic HSDP on torchft", border_style="blue")


EQUAL = {True: Text("yes", style="green"), False: Text("NO", style="red")}
"""How a drill's fingerprints_equal reads."""


def report_table(title: str) -> Table:
    """A drill report: one "what | value" row per measurement."""
    table = Table(title=title, show_header=False, expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    return table


def add_error(table: Table, drill: dict) -> Table:
    if drill.get("error"):
        table.add_row("error", Text(drill["error"], style="red"))
    return table


REJOINED_BY = {"agent": "its agent (fail-over)", "drill": "the drill",
               "control-plane": "the control plane, once it reached every group", "network": "itself: its ranks "
               "waited through the cut"}


def partition_rows(r: dict) -> list[tuple[str, str]]:
    """What only a partition drill reports: the cut, and the control plane's verdict on it."""
    cut = f"groups {r['cut'][0]} and {r['cut'][1]} apart" if r.get("cut") else f"group {r['isolate']} from the job"
    evicted = r.get("evicted") or []
    return [
        ("cut", f"{cut} for {r['duration_s']:g} s"),
        ("hosts cut", "; ".join(f"group {g}: {a}" for g, a in sorted((r.get("addresses") or {}).items())) or "-"),
        ("cut → evicted", f"group(s) {', '.join(map(str, evicted))} after {r['cut_to_verdict_s']:.2f} s"
         if evicted and r.get("cut_to_verdict_s") is not None
         else "none: a lost node, the quorum leaves it out" if r.get("isolate") is not None else "-"),
        ("kept", ", ".join(map(str, r.get("kept") or [])) or "-"),
        ("rule", r.get("rule") or "-"),
    ]


def drill_table(drill: dict) -> Table:
    if drill["kind"] == "chaos":
        return chaos_table(drill)
    if drill["kind"] == "lighthouse":
        return lighthouse_table(drill)
    if drill["kind"] == "straggler":
        return straggler_table(drill)
    if drill["kind"] == "corrupt":
        return corrupt_table(drill)
    r = drill["report"]
    table = report_table(f"drill {drill['id']} · {drill['kind']} · group {drill['group']} · {drill['status']}")
    fault = "cut" if drill["kind"] == "partition" else "kill"

    def secs(key: str) -> str:
        return f"{r[key]:.2f} s" if r.get(key) is not None else "-"

    def value(key: str) -> str:
        return str(r[key]) if r.get(key) is not None else "-"

    rows = [
        ("phase", r.get("phase")),
        ("survivors", ", ".join(map(str, r.get("survivors", [])))),
        *([("fault", f"{r['mode']} " + (f"rank {r['rank']}" if r.get("rank") is not None else "every rank")),
           ("ended by", {"watchdog": "its agent's watchdog", "agent": "its processes exiting"}.get(
               r.get("detected_by"), "-")),
           ("hang → group ended", secs("fault_to_end_s")), ("verdict", value("verdict"))]
          if drill["kind"] == "hang" else []),
        *(partition_rows(r) if drill["kind"] == "partition" else []),
        (f"{fault} → quorum shrank (detect)", secs("detect_s")),
        (f"{fault} → survivors commit again", secs("survivors_resume_s")),
        ("survivor steps lost", value("survivors_steps_lost")),
        ("rejoined by", REJOINED_BY.get(r.get("rejoined_by"), "-")),
        ("rejoin → healed commit", secs("rejoin_to_healed_commit_s")),
        *([("mended → healed commit", secs("mend_to_healed_commit_s"))] if drill["kind"] == "partition" else []),
        (f"{fault} → all groups training", secs("kill_to_full_s")),
        ("healed at step", value("healed_step")),
        ("heal transfer (rank 0)", f"{r['heal_bytes'] / 2**20:.1f} MiB in {r['heal_fetch_s']:.2f} s"
         if r.get("heal_bytes") is not None else "-"),
        ("fingerprints at step", value("fingerprint_step")),
        ("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-")),
    ]
    for what, shown in rows:  # text from the job (a verdict, a phase) is shown as it is, never as markup
        table.add_row(what, shown if isinstance(shown, Text) else Text(str(shown)))
    return add_error(table, drill)


def lighthouse_table(drill: dict) -> Table:
    r = drill["report"]
    table = report_table(f"drill {drill['id']} · lighthouse · {drill['status']}")
    secs = lambda v: f"{v:.2f} s" if v is not None else "-"  # noqa: E731
    table.add_row("phase", Text(str(r.get("phase"))))
    table.add_row("Lighthouse killed → noticed", secs(r.get("detect_s")))
    table.add_row("Lighthouse away", secs(r.get("away_s")))
    for g, p in sorted((r.get("pauses") or {}).items(), key=lambda kv: int(kv[0])):
        table.add_row(f"group {g}", f"paused {secs(p.get('pause_s'))}, committed {secs(p.get('resume_after_back_s'))} "
                                    f"after it answered, {p.get('steps_lost', 0)} step(s) lost")
    exits = r.get("process_exits") or []
    table.add_row("group processes ended", Text(", ".join(exits), style="red") if exits else Text("none", style="green"))
    table.add_row("fingerprints at step", str(r["fingerprint_step"]) if r.get("fingerprint_step") is not None else "-")
    table.add_row("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-"))
    return add_error(table, drill)


def straggler_table(drill: dict) -> Table:
    r = drill["report"]
    table = report_table(f"drill {drill['id']} · straggler · group {r['group']} +{r['delay_ms']:g} ms for "
                         f"{r['duration_s']:g}s · policy {r['policy']} · {drill['status']}")
    table.add_row("phase", Text(str(r.get("phase"))))
    found = r.get("detected_group")
    table.add_row("flagged", "nobody" if found is None else
                  Text(f"group {found} after {r['detect_s']:.1f} s", style="green" if found == r["group"] else "red"))
    if found is not None:
        table.add_row("slowdown · relative · individual",
                      f"{r['slowdown']:.2f}× · {r['relative']:.2f} · {r['individual']:.2f}")
        table.add_row("verdict", r.get("detail") or "-")
    table.add_row("action", r.get("action") or "-")
    if r.get("ended"):
        table.add_row("went down", Text(r["ended"], style="red"))
    others = r.get("others_flagged") or []
    table.add_row("others flagged", Text(", ".join(map(str, others)), style="red") if others else Text("none", style="green"))
    rates = r.get("throughput") or {}
    steps = r.get("median_step_s") or {}
    for when in ("before", "during", "after"):
        rate, step = rates.get(when), steps.get(when)
        table.add_row(f"throughput {when}", (f"{rate:.2f} samples/s" if rate is not None else "-")
                      + (f" · {step:.2f} s/step" if step is not None else ""))
    return add_error(table, drill)


def _norm(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.3g}"


def _per_group(values: dict, fmt: str) -> str:
    return ", ".join(f"g{g} {format(v, fmt) if v is not None else '-'}" for g, v in sorted(values.items())) or "-"


def corrupt_table(drill: dict) -> Table:
    r = drill["report"]
    table = report_table(f"drill {drill['id']} · corrupt · group {r['group']} rank {r['rank']} ×{r['scale']:g} "
                         f"{'every step' if r['persistent'] else 'once'} · check "
                         f"{ {True: 'on', False: 'OFF', None: '?'}[r.get('sdc_check')] } · {drill['status']}")
    table.add_row("phase", Text(str(r.get("phase"))))
    table.add_row("corrupted step", str(r["step"]) if r.get("step") is not None else "-")
    if r.get("sdc_check"):
        found = r.get("detected_group")
        table.add_row("flagged", "nobody" if found is None else Text(
            f"group {found}, verdict after {r['detect_s']:.2f} s", style="green" if found == r["group"] else "red"))
        if r.get("norms"):
            table.add_row("norms", ", ".join(f"g{g} {_norm(n)}" for g, n in sorted(r["norms"].items()))
                          + f" (others' median {_norm(r.get('reference_norm'))})")
            table.add_row("reruns", f"its own {_norm(r.get('rerun_norm'))}; group {r.get('checker_group')}'s of its "
                                    f"batch {_norm(r.get('checker_norm'))}")
        table.add_row("verdict", Text(r.get("verdict") or "-", style="bold"))
    table.add_row("action", r.get("action") or "-")
    if r.get("replace_s") is not None:
        table.add_row("quarantine → spare's healed commit", f"{r['replace_s']:.2f} s")
    table.add_row("largest update / usual", _per_group(r.get("update_ratio") or {}, ".3g"))
    table.add_row("largest applied gradient / usual", _per_group(r.get("applied_grad_ratio") or {}, ".3g"))
    table.add_row("loss after − before", _per_group(r.get("loss_change") or {}, "+.3f"))
    table.add_row("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-"))
    return add_error(table, drill)


def chaos_table(drill: dict) -> Table:
    r = drill["report"]
    table = report_table(f"drill {drill['id']} · chaos · mtbf {r['mtbf_s']:g}s · {r['duration_s']:g}s · seed {r['seed']} · "
                         f"{drill['status']}")
    rate = lambda v: f"{v:.2f} samples/s" if v is not None else "-"  # noqa: E731
    table.add_row("failure-free rate", rate(r.get("baseline_rate")))
    table.add_row("rate under chaos", rate(r.get("chaos_rate")))
    table.add_row("goodput", f"{100 * r['goodput']:.1f}%" if r.get("goodput") is not None else "-")
    table.add_row("kills", ", ".join(f"g{k['group']}" for k in r.get("kills", [])) or "none")
    if r.get("baseline_step_s") and r.get("chaos_step_s"):
        table.add_row("median step", f"{r['baseline_step_s']:.2f} s failure-free, {r['chaos_step_s']:.2f} s under chaos "
                                     f"({r['chaos_step_s'] / r['baseline_step_s']:.2f}×)")
    for term, seconds in (r.get("lost_s") or {}).items():
        table.add_row(f"lost to {term.replace('_', ' ')}", f"{seconds:.1f} s")
    return add_error(table, drill)
