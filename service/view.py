"""Terminal views of the cluster (rich)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from service.controlplane.drills import DRILLS

STATE_STYLE = {"training": "bold green", "healing": "bold yellow", "joining": "cyan", "starting": "cyan",
               "down": "bold red", "unknown": "dim"}


SDC_SHOWN_S = 600.0
"""A group's latest gradient-check incident stays in its row this long."""


def _age(ts: float | None) -> str:
    if ts is None:
        return "-"
    seconds = max(0.0, time.time() - ts)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


COLUMNS = ("group", "state", "step", "loss", "s/step", "for", "restarts", "groups", "quorum", "last heal")
"""The group table's columns, most useful first: a narrow terminal drops them from the end."""
LEFT = ("state", "last heal")


def group_cells(g: dict) -> dict[str, str | Text]:
    state = g["state"] + (f" ({g['down_reason']})" if g.get("down_reason") else "")
    if g.get("straggler"):
        state += f" · straggler ×{g['straggler']['slowdown']:.2f}"
    sdc = g.get("last_sdc")
    if sdc and time.time() - sdc["ts"] < SDC_SHOWN_S:
        state += f" · SDC {sdc['verdict']} @{sdc['step']}"
    heal = g.get("last_heal")
    loss = g.get("loss")
    return {
        "group": str(g["group"]),
        "state": Text(state, style=STATE_STYLE.get(g["state"], "")),
        "step": str(g["step"] if g["step"] is not None else "-"),
        "loss": Text("NaN", style="bold red") if g.get("diverged") else f"{loss:.3f}" if loss is not None else "-",
        "s/step": f"{g['step_s']:.2f}" if g.get("step_s") is not None else "-",
        "for": _age(g.get("since")),
        "restarts": str(g.get("restarts", 0)),
        "groups": str(g["participants"] if g.get("participants") is not None else "-"),
        "quorum": str(g["quorum_id"] if g.get("quorum_id") is not None else "-"),
        "last heal": (f"@{heal['step']} ← g{heal['source_group']} {heal['bytes'] / 2**20:.0f} MiB "
                      f"{heal['fetch_s']:.1f}s, {_age(heal['ts'])} ago") if heal else "-",
    }


def fitting(rows: list[dict[str, str | Text]], width: int) -> list[str]:
    """The leading columns of :data:`COLUMNS` whose widest cells fit ``width`` (the panel's border
    and padding, 4, the table's last border, 1, and 3 around each column); never fewer than the
    group and its state."""
    shown, used = [], 5
    for name in COLUMNS:
        need = max([len(name), *(len(str(r[name])) for r in rows)]) + 3
        if len(shown) >= 2 and used + need > width:
            break
        shown.append(name)
        used += need
    return shown


def groups_table(groups: list[dict], width: int = 200) -> Table:
    rows = [group_cells(g) for g in groups]
    columns = fitting(rows, width)
    table = Table(expand=True, header_style="bold")
    for name in columns:
        table.add_column(name, justify="left" if name in LEFT else "right", no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(row[name] for name in columns))
    return table


def progress_line(groups: list[dict], data: dict | None) -> Text | None:
    """The way to ``--steps``: the furthest group's step, tokens per second over the committed
    steps (the data ledger's), and the time left at the current step time."""
    steps = ((data or {}).get("job") or {}).get("steps")
    done = max((g["step"] for g in groups if g.get("step") is not None), default=None)
    if not steps or done is None:
        return None
    share = min(1.0, done / steps)
    bar = "█" * round(24 * share) + "░" * (24 - round(24 * share))
    line = Text(f"{bar} step {done:,}/{steps:,} ({100 * share:.0f}%)")
    rate = (data or {}).get("tokens_per_s")
    if rate:
        line.append(f" · {rate:,.0f} tokens/s")
    step_s = [g["step_s"] for g in groups if g.get("step_s") and g["state"] == "training"]
    if step_s and done < steps:
        left = (steps - done) * sorted(step_s)[len(step_s) // 2]
        line.append(f" · ETA {_duration(left)}")
    return line


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def why_down(groups: list[dict]) -> list[Text]:
    """A line for each down group its agent said why of (a crash's last error line)."""
    return [Text(f"group {g['group']} {g['down_reason']}: {g['down_detail']}", style="red")
            for g in groups if g.get("down_detail")]


def data_line(data: dict | None) -> Text | None:
    """The job's data and what its committed steps trained of it (``GET /data``)."""
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


def cluster_view(quorum: dict, header: str = "", data: dict | None = None, width: int = 200) -> Panel:
    """Quorum, the job's data and progress, a row per group (the columns that fit ``width``)."""
    if quorum.get("lighthouse_reachable"):
        beating = quorum.get("heartbeating")
        top = (f"quorum [bold]{quorum['quorum_id']}[/]  ·  members "
               f"{', '.join('g' + str(m['group']) for m in quorum['members']) or 'none'}  ·  "
               f"{beating if beating is not None else '?'} heartbeating")
    else:
        top = f"[red]Lighthouse unreachable:[/] {escape(str(quorum.get('lighthouse_error')))}"
    parts = [Text.from_markup(header)] if header else []
    lines = [line for line in (data_line(data), progress_line(quorum["groups"], data)) if line]
    return Panel(Group(*parts, Text.from_markup(top), *lines, groups_table(quorum["groups"], width),
                       *why_down(quorum["groups"])),
                 title="ftctl · elastic HSDP on torchft", border_style="blue")


def drill_table(drill: dict) -> Table:
    """A drill's report, as its kind lays it out (``Drill.rows``): one "what | value" row each."""
    kind = DRILLS[drill["kind"]]
    table = Table(title=f"drill {drill['id']} · {kind.title(drill)} · {drill['status']}", show_header=False,
                  expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, shown in kind.rows(drill["report"]):  # text from the job (a verdict, a phase) is never markup
        table.add_row(what, shown if isinstance(shown, Text) else Text(str(shown)))
    if drill.get("error"):
        table.add_row("error", Text(drill["error"], style="red"))
    return table
