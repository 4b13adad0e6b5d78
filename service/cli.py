"""``ftctl``: start a fault-tolerant HSDP job and drive it (status, kill, rejoin, drills, events)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live

from service.auth import new_token
from service.client import DEFAULT_STATE_DIR, ApiError, Connection
from service.launcher import Cluster, StartupError, UpConfig
from service.view import cluster_view, drill_table

console = Console()
err_console = Console(stderr=True)


def _connection(args) -> Connection:
    return Connection.resolve(args.api, args.token, Path(args.state_dir))


def cmd_up(args) -> int:
    token = os.environ.get("FTCTL_TOKEN") or new_token()
    cfg = UpConfig(groups=args.groups, nproc_per_group=args.nproc_per_group, steps=args.steps, port=args.port,
                   host=args.host, state_dir=Path(args.state_dir), lighthouse_port=args.lighthouse_port,
                   token=token, trainer_args=args.trainer_arg or [], auto_rejoin_delay_s=args.auto_rejoin_delay,
                   min_replicas=args.min_replicas, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                   join_timeout_ms=args.join_timeout_ms, spares=args.spares)
    cluster = Cluster(cfg)
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        with console.status("starting the Lighthouse, the control plane and the agents…"):
            cluster.start()
    except StartupError as err:
        cluster.stop()
        err_console.print(f"ftctl: error: {err}")
        return 1
    header = (f"API  [bold]{cfg.api}[/]  (docs {cfg.api}/docs)   Lighthouse {cluster.lighthouse_url}\n"
              f"token [bold]{token}[/]   state {cfg.state_dir}/   Ctrl-C stops everything")
    console.print(header.replace("[bold]", "").replace("[/]", ""))
    conn = Connection(cfg.api, token)
    code = 0
    try:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not stopping["flag"]:
                for name in cluster.revive():
                    console.print(f"[yellow]{name} had exited; restarted it[/]")
                try:
                    quorum = conn.call("GET", "/api/v1/quorum")
                    live.update(cluster_view(quorum, header))
                    if all(g["down_reason"] == "finished" for g in quorum["groups"]):
                        console.print(f"all groups finished {cfg.steps} steps")
                        break
                except ApiError as err:
                    live.update(f"[red]{err}[/]")
                time.sleep(args.refresh)
    finally:
        with console.status("stopping the agents (each stops its group), the control plane, the Lighthouse…"):
            left = cluster.stop()
        if left:
            err_console.print(f"ftctl: error: processes still alive after stop: {left}")
            code = 1
        else:
            console.print("stopped; no process left behind")
    return code


def cmd_status(args) -> int:
    quorum = _connection(args).call("GET", "/api/v1/quorum")
    if args.json:
        print(json.dumps(quorum, indent=2))
    else:
        console.print(cluster_view(quorum))
    return 0


def cmd_group_action(args) -> int:
    result = _connection(args).call("POST", f"/api/v1/groups/{args.group}/{args.command}")
    state = result["group_state"]
    console.print(f"group {args.group}: {args.command} done; now {state['state']}"
                  + (f" ({state['down_reason']})" if state.get("down_reason") else ""))
    return 0


def cmd_drill(args) -> int:
    conn = _connection(args)
    if args.kind == "kill-heal":
        if args.group is None:
            raise ApiError("drill kill-heal needs --group G")
        body = {"kind": "kill-heal", "group": args.group, **({"timeout_s": args.timeout} if args.timeout else {})}
    else:
        body = {"kind": "chaos", "mtbf_s": args.mtbf, "duration_s": args.duration, "seed": args.seed,
                "rejoin_delay_s": args.rejoin_delay, "baseline_s": args.baseline}
    drill = conn.call("POST", "/api/v1/drills", json=body)
    with console.status(f"drill {drill['id']}: {drill['report']['phase']}") as status:
        while drill["status"] == "running":
            time.sleep(0.5)
            drill = conn.call("GET", f"/api/v1/drills/{drill['id']}")
            status.update(f"drill {drill['id']}: {drill['report']['phase']}…")
    if args.json:
        print(json.dumps(drill, indent=2))
    else:
        console.print(drill_table(drill))
    if drill["status"] != "done":
        err_console.print(f"ftctl: error: drill {drill['id']} failed: {drill['error']}")
        return 1
    if args.kind == "kill-heal" and not drill["fingerprints_equal"]:
        err_console.print(f"ftctl: error: drill {drill['id']}: groups hold different state after the heal")
        return 1
    return 0


def _print_event(event: dict) -> None:
    rest = {k: v for k, v in event.items() if k not in ("id", "ts", "group", "rank", "type")}
    when = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    rank = f"r{event['rank']}" if event.get("rank") is not None else "  "
    console.print(f"{when} g{event['group']} {rank} [bold]{event['type']:<13}[/] {json.dumps(rest)}", highlight=False)


def cmd_events(args) -> int:
    conn = _connection(args)
    params = {k: v for k, v in (("group", args.group), ("type", args.type)) if v is not None}
    page = conn.call("GET", "/api/v1/events", params={**params, "limit": args.limit,
                                                      **({"since": time.time() - args.since} if args.since else {})})
    for event in page["events"]:
        _print_event(event)
    if not args.follow:
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


def cmd_ledger(args) -> int:
    from service.ledger import HOUR, Cluster, NoProgress, Recovery, describe, sweep, young_interval

    rec = Recovery(args.detect, args.restart, args.load, args.delta)
    for gpus in args.gpus:
        cluster = Cluster(gpus, args.gpu_mtbf_hours)
        print(f"== {gpus} GPUs, per-GPU MTBF {args.gpu_mtbf_hours:,.0f} h, cluster MTBF {cluster.mtbf_s / HOUR:.2f} h; "
              f"detect {args.detect:g}s restart {args.restart:g}s load {args.load:g}s delta {args.delta:g}s")
        try:
            rows = sweep(cluster, rec, tuple(args.tau) if args.tau else (2, 5, 10, 15, 30, 60))
        except NoProgress as err:
            raise ApiError(str(err)) from None
        opt = young_interval(args.delta, cluster.mtbf_s)
        for g in rows:
            print(("  opt " if abs(g.tau_s - opt) < 1e-6 else "      ") + describe(g))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftctl", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api", help="control-plane URL (env FTCTL_API; default: what `ftctl up` saved, else http://127.0.0.1:8000)")
    common.add_argument("--token", help="bearer token (env FTCTL_TOKEN; default: what `ftctl up` saved)")
    common.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="where `ftctl up` keeps its state (default ./ftstate)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[common], help="start the Lighthouse, the control plane and N replica groups")
    up.add_argument("--groups", type=int, default=2, help="replica groups N (default 2)")
    up.add_argument("--nproc-per-group", type=int, default=2, help="ranks per group K (default 2)")
    up.add_argument("--steps", type=int, default=2000, help="train until this step (default 2000)")
    up.add_argument("--port", type=int, default=8000, help="control-plane port (default 8000)")
    up.add_argument("--host", default="127.0.0.1", help="control-plane bind address (default loopback)")
    up.add_argument("--lighthouse-port", type=int, default=29510, help="torchft Lighthouse port (default 29510)")
    up.add_argument("--min-replicas", type=int, default=1, help="fewest groups that may commit a step (default 1)")
    up.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="Lighthouse failure detection (default 1000)")
    up.add_argument("--join-timeout-ms", type=int, default=1000,
                    help="how long a new quorum waits for groups that have not asked to join (default 1000); "
                    "shorter lets a promoted spare in before the dead group's heartbeat times out")
    up.add_argument("--spares", type=int, default=0,
                    help="keep a warm spare for the first S groups: rejoin promotes it instead of starting cold")
    up.add_argument("--auto-rejoin-delay", type=float, default=None, help="rejoin a killed group by itself after this many seconds")
    up.add_argument("--trainer-arg", action="append", help="extra trainer flag, repeatable: --trainer-arg=--seq-len=64")
    up.add_argument("--refresh", type=float, default=1.0, help="seconds between live-view refreshes")
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", parents=[common], help="quorum and groups, once")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    for name, text in (("kill", "SIGKILL a replica group's processes"), ("rejoin", "start a down group again; it heals from a peer")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("group", type=int)
        p.set_defaults(func=cmd_group_action)

    drill = sub.add_parser("drill", parents=[common], help="run a drill and print its report")
    drill.add_argument("kind", choices=["kill-heal", "chaos"])
    drill.add_argument("--group", type=int, help="kill-heal: the group to kill")
    drill.add_argument("--timeout", type=float, help="kill-heal: seconds per phase")
    drill.add_argument("--mtbf", type=float, default=30.0, help="chaos: mean seconds between kills")
    drill.add_argument("--duration", type=float, default=120.0, help="chaos: seconds of chaos")
    drill.add_argument("--seed", type=int, default=0, help="chaos: random seed (same seed, same kills)")
    drill.add_argument("--rejoin-delay", type=float, default=5.0, help="chaos: seconds before a killed group rejoins")
    drill.add_argument("--baseline", type=float, default=20.0, help="chaos: failure-free seconds measured first")
    drill.add_argument("--json", action="store_true")
    drill.set_defaults(func=cmd_drill)

    ledger = sub.add_parser("ledger", help="goodput under failures at scale (the seed's availability model)")
    ledger.add_argument("--gpus", type=int, nargs="+", default=[1024, 16384])
    ledger.add_argument("--gpu-mtbf-hours", type=float, default=50_000.0,
                        help="per-GPU MTBF (Llama 3: 16,384 GPUs, 419 interruptions in 54 days: ~50,700 h)")
    ledger.add_argument("--detect", type=float, default=600.0, help="T_d seconds (NCCL watchdog default 600)")
    ledger.add_argument("--restart", type=float, default=300.0, help="T_r seconds (relaunch, rendezvous, comm init)")
    ledger.add_argument("--load", type=float, default=120.0, help="T_l seconds (checkpoint load, or heal)")
    ledger.add_argument("--delta", type=float, default=300.0, help="exposed seconds of one checkpoint")
    ledger.add_argument("--tau", type=float, nargs="*", help="fixed checkpoint intervals to show, in minutes")
    ledger.set_defaults(func=cmd_ledger)

    events = sub.add_parser("events", parents=[common], help="print events; --follow streams new ones")
    events.add_argument("--follow", "-f", action="store_true")
    events.add_argument("--group", type=int)
    events.add_argument("--type")
    events.add_argument("--limit", type=int, default=50)
    events.add_argument("--since", type=float, help="only the last N seconds")
    events.set_defaults(func=cmd_events)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ApiError as err:
        err_console.print(f"ftctl: error: {err}", highlight=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
