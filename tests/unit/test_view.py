"""The terminal's drill reports, rendered by rich as `ftctl drill` prints them."""

from __future__ import annotations

from rich.console import Console

from service.controlplane.drills.chaos import ChaosKill, ChaosReport
from service.controlplane.drills.kill_heal import KillHealReport
from service.view import drill_table


def rows(drill: dict) -> dict[str, str]:
    """The table's rows, ``what → value``, as the terminal shows them."""
    console = Console(width=160, color_system=None)
    with console.capture() as captured:
        console.print(drill_table(drill))
    cells = [line.strip().strip("│").split("│") for line in captured.get().splitlines() if line.startswith("│")]
    return {what.strip(): value.strip() for what, value in cells}


def test_a_fail_over_drill_says_who_rejoined_and_when_all_groups_trained_again():
    report = KillHealReport(group=1, survivors=[0], participants_before=2, killed_at=100.0, rejoined_at=100.1,
                            rejoined_by="agent", detect_s=0.41, survivors_resume_s=1.09, survivors_steps_lost=1,
                            rejoin_to_healed_commit_s=0.97, kill_to_full_s=1.07, phase="done")
    shown = rows({"id": 7, "kind": "kill-heal", "group": 1, "status": "done", "report": report.model_dump()})
    assert shown["rejoined by"] == "its agent (fail-over)"
    assert shown["kill → all groups training"] == "1.07 s"
    assert shown["survivor steps lost"] == "1"
    assert shown["healed at step"] == "-" and shown["fingerprints at step"] == "-"  # not measured yet


def test_a_chaos_report_shows_how_much_slower_steps_ran_under_chaos():
    report = ChaosReport(mtbf_s=30, duration_s=240, seed=1, rejoin_delay_s=5, baseline_s=60, phase="done",
                         baseline_rate=2.67, chaos_rate=1.96, goodput=0.736, baseline_step_s=0.52, chaos_step_s=0.78,
                         kills=[ChaosKill(group=0, killed_at=1.0)], lost_s={"detect": 6.1, "waiting_to_rejoin": 0.8})
    shown = rows({"id": 8, "kind": "chaos", "group": None, "status": "done", "report": report.model_dump()})
    assert shown["goodput"] == "73.6%" and shown["lost to waiting to rejoin"] == "0.8 s"
    assert shown["median step"] == "0.52 s failure-free, 0.78 s under chaos (1.50×)"


def test_text_from_the_server_is_printed_as_it_is_never_as_markup(capsys):
    """An error or an event holding rich's markup (``[/x]`` closes a tag never opened) used to crash ftctl."""
    from service.cli import _print_event, error

    error("drill 3 failed: heal: RuntimeError: bad tensor [/x] [bold]")
    _print_event({"id": 1, "ts": 0.0, "group": 0, "rank": 0, "type": "exit", "reason": "error", "step": 3,
                  "error": "RuntimeError('[/x] closing nothing')"})
    out, err = capsys.readouterr()
    assert "heal: RuntimeError: bad tensor [/x] [bold]" in err
    assert "[/x] closing nothing" in out
    failed = rows({"id": 3, "kind": "kill-heal", "group": 1, "status": "failed", "error": "heal: [/x] [red]",
                   "report": KillHealReport(group=1).model_dump()})
    assert failed["error"] == "heal: [/x] [red]"


def test_a_narrow_terminal_drops_the_least_useful_columns_instead_of_cutting_every_one():
    from service.view import cluster_view

    groups = [{"group": g, "state": "down", "down_reason": "finished", "since": None, "step": 40, "loss": 2.671,
               "step_s": 0.58, "participants": 2, "quorum_id": 17, "restarts": 0, "last_heal": None} for g in (0, 1)]
    quorum = {"lighthouse_reachable": True, "quorum_id": 17, "members": [], "heartbeating": 0, "groups": groups}
    headers = {}
    for width in (80, 160):
        console = Console(width=width, color_system=None)
        with console.capture() as captured:
            console.print(cluster_view(quorum, width=width))
        shown = captured.get()
        assert "…" not in shown and "down (finished)" in shown and "2.671" in shown, shown
        headers[width] = next(line for line in shown.splitlines() if "┃" in line)
    assert "restarts" in headers[80] and "quorum" not in headers[80], headers[80]
    assert "quorum" in headers[160] and "last heal" in headers[160], headers[160]
