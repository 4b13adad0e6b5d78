"""``ftctl``: start a fault-tolerant HSDP job and drive it (status, kill, rejoin, drills, events)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, CliPositionalArg, CliSubCommand, SettingsConfigDict
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from protocol.settings import fail, parse_settings
from protocol.tokens import new_token, token_problem
from service.client import CONNECTION_FILE, DEFAULT_API, DEFAULT_STATE_DIR, ApiError, Connection
from service.launcher import LocalJob, StartupError, StateLock, UpSettings
from service.view import cluster_view, drill_table

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error stays one line


def error(line: str) -> None:
    """One line on stderr, as it is: text from the server or a user (``[/x]``) is never markup."""
    err_console.print(f"ftctl: error: {line}", markup=False, highlight=False)


DRILL_POLL_S = 0.5
"""How often a running drill's report is read while the terminal shows its phase."""


class ApiFlags(BaseModel):
    """Where the control plane is: flags, then FTCTL_API / FTCTL_TOKEN, then what `ftctl up` saved."""

    api: str | None = Field(None, description=f"control-plane URL (env FTCTL_API; default: what `ftctl up` saved, "
                            f"else {DEFAULT_API})")
    token: str | None = Field(None, description="bearer token (env FTCTL_TOKEN; default: what `ftctl up` saved)")
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="where `ftctl up` keeps its state")

    def connection(self) -> Connection:
        return Connection.resolve(self.api, self.token, self.state_dir)


class StatusCommand(ApiFlags):
    as_json: bool = Field(False, validation_alias=AliasChoices("json"), description="print the API's JSON")


class GroupCommand(ApiFlags):
    group: CliPositionalArg[int] = Field(description="the replica group")


class DrillCommand(ApiFlags):
    kind: CliPositionalArg[Literal["kill-heal", "hang", "lighthouse", "chaos", "straggler", "corrupt", "partition"]] = (
        Field(description="kill-heal, hang, lighthouse, chaos, straggler, corrupt or partition"))
    group: int | None = Field(None, ge=0, description="kill-heal, hang, straggler, corrupt: the group to fault")
    rank: int | None = Field(None, ge=0, description="hang: only this rank (default: every rank of the group); "
                             "corrupt: the rank whose gradient is corrupted (default 0)")
    mode: Literal["stop", "stuck"] = Field("stop", description="hang: stop (SIGSTOP the ranks) or stuck (a rank "
                                           "sleeps inside its step)")
    down: float = Field(0.0, ge=0, description="lighthouse: seconds to keep it down (default: the wrapper's "
                        "restart delay)")
    cut: str | None = Field(None, description="partition: G1,G2, two groups whose hosts stop reaching each other")
    isolate: int | None = Field(None, ge=0, description="partition: the group whose host stops reaching the whole job")
    timeout: float | None = Field(None, gt=0, description="kill-heal, hang, lighthouse, corrupt, partition: seconds "
                                  "per phase (default: the control plane's)")
    mtbf: float = Field(30.0, gt=0, description="chaos: mean seconds between kills")
    duration: float | None = Field(None, gt=0, description="chaos: seconds of chaos (default 120); straggler: "
                                   "seconds the group stays slow (default 30); partition: seconds the cut lasts "
                                   "(default 20)")
    delay_ms: float = Field(30.0, gt=0, description="straggler: the sleep before every forward")
    policy: Literal["flag", "evict"] | None = Field(None, description="straggler: the straggler policy while it "
                                                    "runs (default: the job's)")
    scale: float = Field(1e4, description="corrupt: the factor one gradient element is multiplied by")
    persistent: bool = Field(False, description="corrupt: every step, as a bad chip would (default: once)")
    seed: int = Field(0, description="chaos: random seed (same seed, same kills)")
    rejoin_delay: float | None = Field(None, ge=0, description="chaos: seconds before a killed group rejoins "
                                       "(default: the control plane's)")
    baseline: float | None = Field(None, gt=0, description="chaos: failure-free seconds measured first "
                                   "(default: the control plane's)")
    as_json: bool = Field(False, validation_alias=AliasChoices("json"), description="print the report's JSON")

    def body(self) -> dict:
        if self.kind == "straggler":
            if self.group is None:
                raise ApiError("drill straggler needs --group G")
            fields = {"group": self.group, "delay_ms": self.delay_ms, "duration_s": self.duration,
                      "policy": self.policy}
        elif self.kind == "corrupt":
            if self.group is None:
                raise ApiError("drill corrupt needs --group G")
            fields = {"group": self.group, "rank": self.rank, "scale": self.scale, "persistent": self.persistent,
                      "timeout_s": self.timeout}
        elif self.kind in ("kill-heal", "hang"):
            if self.group is None:
                raise ApiError(f"drill {self.kind} needs --group G")
            fields = {"group": self.group, "timeout_s": self.timeout}
            if self.kind == "hang":
                fields |= {"rank": self.rank, "mode": self.mode}
        elif self.kind == "partition":
            fields = {"cut": self._pair(), "isolate": self.isolate, "duration_s": self.duration,
                      "timeout_s": self.timeout}
        elif self.kind == "lighthouse":
            fields = {"down_s": self.down, "timeout_s": self.timeout}
        else:
            fields = {"mtbf_s": self.mtbf, "duration_s": self.duration or 120.0, "seed": self.seed,
                      "rejoin_delay_s": self.rejoin_delay, "baseline_s": self.baseline}
        return {"kind": self.kind, **{k: v for k, v in fields.items() if v is not None}}

    def _pair(self) -> list[int] | None:
        if (self.cut is None) == (self.isolate is None):
            raise ApiError("drill partition needs --cut G1,G2 or --isolate G (one of them)")
        if self.cut is None:
            return None
        try:
            pair = [int(g) for g in self.cut.split(",")]
        except ValueError:
            pair = []
        if len(pair) != 2 or min(pair) < 0:
            raise ApiError(f"--cut takes two group numbers, as 1,2; not {self.cut!r}")
        return pair


class EventsCommand(ApiFlags):
    follow: bool = Field(False, validation_alias=AliasChoices("f", "follow"), description="stream new events")
    group: int | None = Field(None, ge=0, description="only this group's events")
    type: str | None = Field(None, description="only events of this type")
    limit: int = Field(50, ge=1, le=1000, description="stored events printed first")
    since: float | None = Field(None, gt=0, description="only the last N seconds")


class LedgerCommand(BaseModel):
    gpus: list[int] = Field([1024, 16384], description="cluster sizes (repeat the flag, or 1024,16384)")
    gpu_mtbf_hours: float = Field(50_000.0, gt=0, description="per-GPU MTBF (Llama 3: 16,384 GPUs, "
                                  "419 interruptions in 54 days: ~50,700 h)")
    detect: float = Field(600.0, ge=0, description="T_d seconds (NCCL watchdog default 600)")
    restart: float = Field(300.0, ge=0, description="T_r seconds (relaunch, rendezvous, comm init)")
    load: float = Field(120.0, ge=0, description="T_l seconds (checkpoint load, or heal)")
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
    conn = Connection(cfg.api, job.token)
    code = 0
    try:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not stopping["flag"]:
                for name in job.revive():
                    console.print(f"[yellow]{name} had exited; restarted it[/]")
                try:
                    quorum = conn.call("GET", "/api/v1/quorum")
                    live.update(cluster_view(quorum, header, conn.call("GET", "/api/v1/data")))
                    if all(g["down_reason"] == "finished" for g in quorum["groups"]):
                        console.print(f"all groups finished {cfg.steps} steps")
                        break
                except ApiError as err:
                    live.update(Text(str(err), style="red"))
                time.sleep(cfg.refresh)
    finally:
        with console.status("stopping the agents (each stops its group), the control plane, the Lighthouse…"):
            left = job.stop()
        if left:
            error(f"processes still alive after stop: {left}")
            code = 1
        else:
            console.print("stopped; no process left behind")
    return code


def cmd_status(cmd: StatusCommand) -> int:
    conn = cmd.connection()
    quorum, data = conn.call("GET", "/api/v1/quorum"), conn.call("GET", "/api/v1/data")
    if cmd.as_json:
        print(json.dumps({**quorum, "data": data}, indent=2))
    else:
        console.print(cluster_view(quorum, data=data))
    return 0


def cmd_group_action(cmd: GroupCommand, action: str) -> int:
    result = cmd.connection().call("POST", f"/api/v1/groups/{cmd.group}/{action}")
    state = result["group_state"]
    console.print(f"group {cmd.group}: {action} done; now {state['state']}"
                  + (f" ({state['down_reason']})" if state.get("down_reason") else ""))
    return 0


def cmd_drill(cmd: DrillCommand) -> int:
    conn = cmd.connection()
    drill = conn.call("POST", "/api/v1/drills", json=cmd.body())
    with console.status(f"drill {drill['id']}: {drill['report']['phase']}") as status:
        while drill["status"] == "running":
            time.sleep(DRILL_POLL_S)
            drill = conn.call("GET", f"/api/v1/drills/{drill['id']}")
            status.update(f"drill {drill['id']}: {drill['report']['phase']}…")
    if cmd.as_json:
        print(json.dumps(drill, indent=2))
    else:
        console.print(drill_table(drill))
    if drill["status"] != "done":
        error(f"drill {drill['id']} failed: {drill['error']}")
        return 1
    if cmd.kind == "straggler":
        r = drill["report"]
        if r.get("ended"):
            error(f"drill {drill['id']}: group {r['group']} went down during it ({r['ended']}); "
                  "a delay over the hang watchdog's step bound is a hang, not a straggler: use a "
                  "shorter --delay-ms")
            return 1
        if r["detected_group"] != r["group"]:
            found = "nobody" if r["detected_group"] is None else f"group {r['detected_group']}"
            error(f"drill {drill['id']}: the detector flagged {found}, not group {r['group']}; "
                  "a delay too short for --straggler-factor is not a straggler (try a longer --delay-ms)")
            return 1
    elif cmd.kind == "corrupt":
        r = drill["report"]
        if r["sdc_check"] and r["detected_group"] != r["group"]:
            found = "nobody" if r["detected_group"] is None else f"group {r['detected_group']}"
            error(f"drill {drill['id']}: the gradient check flagged {found}, not group "
                  f"{r['group']}; a --scale this small may hide in the norm: try a larger one")
            return 1
        if not drill["fingerprints_equal"]:
            error(f"drill {drill['id']}: groups hold different state afterwards")
            return 1
    elif cmd.kind != "chaos" and not drill["fingerprints_equal"]:
        error(f"drill {drill['id']}: groups hold different state after the heal")
        return 1
    return 0


def _print_event(event: dict) -> None:
    rest = {k: v for k, v in event.items() if k not in ("id", "ts", "group", "rank", "type")}
    when = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    rank = f"r{event['rank']}" if event.get("rank") is not None else "  "
    console.print(f"{when} g{event['group']} {rank} [bold]{event['type']:<13}[/] {escape(json.dumps(rest))}",
                  highlight=False)


def cmd_events(cmd: EventsCommand) -> int:
    conn = cmd.connection()
    params = {k: v for k, v in (("group", cmd.group), ("type", cmd.type)) if v is not None}
    page = conn.call("GET", "/api/v1/events", params={**params, "limit": cmd.limit,
                                                      **({"since": time.time() - cmd.since} if cmd.since else {})})
    for event in page["events"]:
        _print_event(event)
    if not cmd.follow:
        return 0
    try:
        with conn.client(timeout=None) as c, c.stream("GET", "/api/v1/events/stream", params=params) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    _print_event(json.loads(line[6:]))
    except httpx.HTTPError as err:
        raise ApiError(f"the event stream from {conn.api} ended: {err}") from None
    except KeyboardInterrupt:
        pass
    return 0


def cmd_ledger(cmd: LedgerCommand) -> int:
    from service.ledger import HOUR, Cluster, NoProgress, Recovery, describe, sweep, young_interval

    rec = Recovery(cmd.detect, cmd.restart, cmd.load, cmd.delta)
    for gpus in cmd.gpus:
        cluster = Cluster(gpus, cmd.gpu_mtbf_hours)
        print(f"== {gpus} GPUs, per-GPU MTBF {cmd.gpu_mtbf_hours:,.0f} h, cluster MTBF {cluster.mtbf_s / HOUR:.2f} h; "
              f"detect {cmd.detect:g}s restart {cmd.restart:g}s load {cmd.load:g}s delta {cmd.delta:g}s")
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
        case "kill" | "rejoin":
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
