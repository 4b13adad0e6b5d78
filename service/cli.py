"""``ftctl``: start a fault-tolerant HSDP job and drive it (status, kill, rejoin, drills, events)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, CliPositionalArg, CliSubCommand, SettingsConfigDict
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from protocol.agent import DrainReason
from protocol.settings import fail, parse_settings
from protocol.tokens import new_token, token_problem
from service.client import CONNECTION_FILE, ApiError, ApiFlags, Connection, ControlPlane
from service.controlplane.drills import DRILLS
from service.drill_command import DrillCommand
from service.launcher import LocalJob, StartupError, StateLock, UpSettings
from service.view import cluster_view, drill_table

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error stays one line


def error(line: str) -> None:
    """One line on stderr, as it is: text from the server or a user (``[/x]``) is never markup."""
    err_console.print(f"ftctl: error: {line}", markup=False, highlight=False)


DRILL_POLL_S = 0.5
"""How often a running drill's report is read while the terminal shows its phase."""


class StatusCommand(ApiFlags):
    as_json: bool = Field(False, validation_alias=AliasChoices("json"), description="print the API's JSON")


class GroupCommand(ApiFlags):
    group: CliPositionalArg[int] = Field(description="the replica group")


class DrainCommand(GroupCommand):
    reason: DrainReason | None = Field(None, description="why (shown in its drained event)")


class EventsCommand(ApiFlags):
    follow: bool = Field(False, validation_alias=AliasChoices("f", "follow"), description="stream new events")
    group: int | None = Field(None, ge=0, description="only this group's events")
    type: str | None = Field(None, description="only events of this type")
    limit: int = Field(50, ge=1, le=1000, description="stored events printed first")
    since: float | None = Field(None, gt=0, description="only the last N seconds")
    as_json: bool = Field(False, validation_alias=AliasChoices("json"), description="one JSON object per line")


class LedgerCommand(BaseModel):
    gpus: list[int] = Field([1024, 16384], description="cluster sizes (repeat the flag, or 1024,16384)")
    gpu_mtbf_hours: float = Field(50_000.0, gt=0, description="per-GPU MTBF (Llama 3: 16,384 GPUs, "
                                  "419 interruptions in 54 days: ~50,700 h)")
    detect: float = Field(600.0, ge=0, description="T_d seconds (NCCL watchdog default 600)")
    restart: float = Field(300.0, ge=0, description="T_r seconds (relaunch, rendezvous, comm init)")
    load: float = Field(120.0, ge=0, description="T_l seconds (checkpoint load, or heal) besides a heal's transfer")
    state_gb_per_rank: float | None = Field(None, gt=0, description="GB of state a healing rank copies (8B "
                                            "parameters with AdamW over 8 GPUs: ~12); with --heal-gb-per-s, "
                                            "its transfer is added to T_l")
    heal_gb_per_s: float | None = Field(None, gt=0, description="GB/s one rank's heal moves (bench/heal measures it)")
    delta: float = Field(300.0, ge=0, description="exposed seconds of one checkpoint")
    tau: list[float] = Field([], description="fixed checkpoint intervals to show, in minutes")


class Ftctl(BaseSettings):
    """ftctl: start a fault-tolerant HSDP job on torchft and drive it."""

    model_config = SettingsConfigDict(cli_prog_name="ftctl", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_exit_on_error=True)

    up: CliSubCommand[UpSettings] = Field(description="start the Lighthouse, the control plane and N replica groups")
    status: CliSubCommand[StatusCommand] = Field(description="quorum and groups, once")
    kill: CliSubCommand[GroupCommand] = Field(description="SIGKILL a replica group's processes")
    rejoin: CliSubCommand[GroupCommand] = Field(description="start a down group again; it heals from a peer")
    drain: CliSubCommand[DrainCommand] = Field(description="take a group out for maintenance: it commits its step, "
                                               "leaves, and stays down until rejoined")
    drill: CliSubCommand[DrillCommand] = Field(description="run a drill and print its report")
    events: CliSubCommand[EventsCommand] = Field(description="print events; --follow streams new ones")
    ledger: CliSubCommand[LedgerCommand] = Field(description="goodput under failures at scale "
                                                 "(the seed's availability model)")


def cmd_up(cfg: UpSettings) -> int:
    token = os.environ.get("FTCTL_TOKEN") or new_token()
    if (problem := token_problem(token)) is not None:
        error(f"FTCTL_TOKEN: {problem}; unset it (ftctl up makes a random one) or set "
              "a random one of 16 characters or more")
        return 2
    try:
        lock = StateLock(cfg.state_dir)
    except StartupError as err:
        error(str(err))
        return 1
    try:
        job = LocalJob(cfg, token)
        try:
            with console.status("checking the job (its config, tokenizer and data) before starting anything…"):
                job.check(lambda line: console.print(line, markup=False, highlight=False))
        except StartupError as err:
            error(str(err))
            return 2
        return _run_job(cfg, job)
    finally:
        lock.release()


def _run_job(cfg: UpSettings, job: LocalJob) -> int:
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, on_signal)
    try:
        with console.status("starting the Lighthouse, the control plane and the agents…"):
            job.start()
    except StartupError as err:
        job.stop()
        error(str(err))
        return 1
    token = job.token if console.is_terminal else f"in {cfg.state_dir / CONNECTION_FILE}"  # never into a log
    header = (f"API  [bold]{cfg.api}[/]  (docs {cfg.api}/docs)   Lighthouse {job.lighthouse_url}\n"
              f"token [bold]{token}[/]   state {cfg.state_dir}/   Ctrl-C stops everything")
    console.print(header.replace("[bold]", "").replace("[/]", ""))
    control = ControlPlane(Connection(cfg.api, job.token))
    code = 0
    try:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not stopping["flag"]:
                for name in job.revive():
                    console.print(f"[yellow]{name} had exited; restarted it[/]")
                try:
                    quorum = control.quorum()
                    live.update(cluster_view(quorum, header, control.data(), console.width))
                    if all(g["down_reason"] == "finished" for g in quorum["groups"]):
                        console.print(f"all groups finished {cfg.steps} steps")
                        break
                except ApiError as err:
                    live.update(Text(str(err), style="red"))
                time.sleep(cfg.refresh)
    finally:
        control.close()
        with console.status("stopping the agents (each stops its group), the control plane, the Lighthouse…"):
            left = job.stop()
        if left:
            error(f"processes still alive after stop: {left}")
            code = 1
        else:
            console.print("stopped; no process left behind")
    return code


def cmd_status(cmd: StatusCommand) -> int:
    with cmd.control_plane() as control:
        quorum, data = control.quorum(), control.data()
    if cmd.as_json:
        print(json.dumps({**quorum, "data": data}, indent=2))
    else:
        console.print(cluster_view(quorum, data=data, width=console.width))
    return 0


def cmd_group_action(cmd: GroupCommand, action: str) -> int:
    with cmd.control_plane() as control:
        if isinstance(cmd, DrainCommand):
            result = control.drain(cmd.group, cmd.reason)
        else:
            result = getattr(control, action)(cmd.group)
    state = result["group_state"]
    console.print(f"group {cmd.group}: {action} done; now {state['state']}"
                  + (f" ({state['down_reason']})" if state.get("down_reason") else ""))
    return 0


def cmd_drill(cmd: DrillCommand) -> int:
    body = cmd.body()
    with cmd.control_plane() as control, console.status(f"drill {cmd.kind}: starting") as status:
        drill = control.run_drill(body, DRILL_POLL_S,
                                  on_phase=lambda d: status.update(f"drill {d['id']}: {d['report']['phase']}…"))
    if cmd.as_json:
        print(json.dumps(drill, indent=2))
    else:
        console.print(drill_table(drill))
    if drill["status"] != "done":
        error(f"drill {drill['id']} failed: {drill['error']}")
        return 1
    problem = DRILLS[drill["kind"]].problem(drill["report"])
    if problem:
        error(f"drill {drill['id']}: {problem}")
        return 1
    return 0


def _print_event(event: dict) -> None:
    rest = {k: v for k, v in event.items() if k not in ("id", "ts", "group", "rank", "type")}
    when = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    rank = f"r{event['rank']}" if event.get("rank") is not None else "  "
    console.print(f"{when} g{event['group']} {rank} [bold]{event['type']:<13}[/] {escape(json.dumps(rest))}",
                  highlight=False)


def cmd_events(cmd: EventsCommand) -> int:
    show = (lambda event: print(json.dumps(event), flush=True)) if cmd.as_json else _print_event
    with cmd.control_plane() as control:
        for event in control.events(cmd.group, cmd.type, time.time() - cmd.since if cmd.since else None, cmd.limit):
            show(event)
        if not cmd.follow:
            return 0
        try:
            for event in control.stream_events(cmd.group, cmd.type):
                show(event)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_ledger(cmd: LedgerCommand) -> int:
    from service.ledger import HOUR, Cluster, NoProgress, Recovery, describe, sweep, young_interval

    if (cmd.state_gb_per_rank is None) != (cmd.heal_gb_per_s is None):
        fail("ledger", "give --state-gb-per-rank and --heal-gb-per-s together: a heal's transfer needs both")
    transfer = cmd.state_gb_per_rank / cmd.heal_gb_per_s if cmd.state_gb_per_rank is not None else 0.0
    load = cmd.load + transfer
    rec = Recovery(cmd.detect, cmd.restart, load, cmd.delta)
    heal = (f" ({cmd.load:g}s + {cmd.state_gb_per_rank:g} GB at {cmd.heal_gb_per_s:g} GB/s)"
            if cmd.state_gb_per_rank is not None else "")
    for gpus in cmd.gpus:
        cluster = Cluster(gpus, cmd.gpu_mtbf_hours)
        print(f"== {gpus} GPUs, per-GPU MTBF {cmd.gpu_mtbf_hours:,.0f} h, cluster MTBF {cluster.mtbf_s / HOUR:.2f} h; "
              f"detect {cmd.detect:g}s restart {cmd.restart:g}s load {load:g}s{heal} delta {cmd.delta:g}s")
        try:
            rows = sweep(cluster, rec, tuple(cmd.tau)) if cmd.tau else sweep(cluster, rec)
        except NoProgress as err:
            raise ApiError(str(err)) from None
        opt = young_interval(cmd.delta, cluster.mtbf_s)
        for g in rows:
            print(("  opt " if abs(g.tau_s - opt) < 1e-6 else "      ") + describe(g))
    return 0


def run(cli: Ftctl) -> int:
    """The one subcommand given, run."""
    name = next((name for name in Ftctl.model_fields if getattr(cli, name) is not None), None)
    if name is None:
        fail("ftctl", f"give a command: {', '.join(Ftctl.model_fields)} (see ftctl --help)")
    cmd = getattr(cli, name)
    match name:
        case "up":
            return cmd_up(cmd)
        case "status":
            return cmd_status(cmd)
        case "kill" | "rejoin" | "drain":
            return cmd_group_action(cmd, name)
        case "drill":
            return cmd_drill(cmd)
        case "events":
            return cmd_events(cmd)
        case "ledger":
            return cmd_ledger(cmd)
    raise AssertionError(f"subcommand {name} has no handler")


def main(argv: list[str] | None = None) -> int:
    cli = parse_settings(Ftctl, "ftctl", sys.argv[1:] if argv is None else argv)
    try:
        return run(cli)
    except ApiError as err:
        error(str(err))
        return 1


if __name__ == "__main__":
    sys.exit(main())
