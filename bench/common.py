"""Shared by the benchmarks: start `ftctl up` on free ports, read its API, stop it."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from protocol import defaults
from protocol.torchrun import free_port
from service.client import ApiError, ControlPlane
from service.proctree import end_tree

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TOKEN = "bench-token-0123456789abcdef"
STOP_GRACE_S = 120.0
"""`ftctl up` stops agents (each its group), the control plane and the Lighthouse in turn."""


def write_result(name: str, settings: dict, path: Path | None = None, **payload) -> Path:
    """``bench/results/{name}-{UTC time}.json`` with the settings, the core count and the date
    (``path``: that file again, for a benchmark that writes what it has after each run)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = path or RESULTS / f"{name}-{now:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps({"settings": settings, "cores": os.cpu_count(), "date": now.isoformat(), **payload},
                              indent=1))
    return out


def job_parser(doc: str | None, group_counts: bool = False) -> argparse.ArgumentParser:
    """Every benchmark's parser: its docstring as help, and the job's shape (``group_counts``:
    several group counts, one job each)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if group_counts:
        parser.add_argument("--groups", type=int, nargs="+", default=[2, 3, 4], help="group counts, a job each")
    else:
        parser.add_argument("--groups", type=int, default=2, help="replica groups")
    parser.add_argument("--ranks-per-group", type=int, default=defaults.RANKS_PER_GROUP, help="ranks per group")
    return parser


def add_recovery_options(parser: argparse.ArgumentParser) -> None:
    """How `ftctl up` recovers a killed group: the flags the recovery and chaos benchmarks share."""
    parser.add_argument("--spares", action="store_true", help="a warm spare per group")
    parser.add_argument("--failover", action="store_true",
                        help="agents bring a killed group back at once by themselves (ftctl up's default) instead of the "
                        "drill later (--no-auto-rejoin)")
    parser.add_argument("--join-timeout-ms", type=int, default=defaults.JOIN_TIMEOUT_MS,
                        help="the Lighthouse's join timeout")
    parser.add_argument("--no-zygote", dest="zygote", action="store_false",
                        help="start every group cold with torchrun, as before the agents had a zygote")


def recovery_settings(args: argparse.Namespace, groups: int | None = None) -> dict:
    """``Up`` keyword arguments from the flags of ``add_recovery_options`` (for ``groups`` groups,
    default ``args.groups``)."""
    return {"spares": (groups or args.groups) if args.spares else 0, "auto_rejoin": args.failover,
            "join_timeout_ms": args.join_timeout_ms, "zygote": args.zygote}


def describe_recovery(args: argparse.Namespace) -> str:
    return (f"heartbeat timeout {defaults.HEARTBEAT_TIMEOUT_MS} ms, join timeout {args.join_timeout_ms} ms, "
            f"spares {'on' if args.spares else 'off'}, rejoin {'by the agent at once' if args.failover else 'by the drill'}, "
            f"starts {'forked by a zygote' if args.zygote else 'cold (torchrun)'}")


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


class Up:
    """`ftctl up` as a subprocess, with a client on its API (``control``)."""

    def __init__(self, state_dir: Path, groups: int, ranks_per_group: int, trainer_args: list[str],
                 heartbeat_timeout_ms: int = defaults.HEARTBEAT_TIMEOUT_MS, spares: int = 0,
                 auto_rejoin: bool = True, join_timeout_ms: int = defaults.JOIN_TIMEOUT_MS,
                 zygote: bool = True):
        self.port = free_port()
        self.state_dir = state_dir
        self.log = open(state_dir.parent / f"{state_dir.name}-ftctl.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "up", "--groups", str(groups), "--ranks-per-group", str(ranks_per_group),
             "--steps", "1000000", "--port", str(self.port), "--lighthouse-port", str(free_port()),
             "--state-dir", str(state_dir), "--heartbeat-timeout-ms", str(heartbeat_timeout_ms),
             "--join-timeout-ms", str(join_timeout_ms),
             "--spares", str(spares),
             *([] if auto_rejoin else ["--no-auto-rejoin"]),
             *([] if zygote else ["--no-zygote"]),
             *[f"--trainer-arg={a}" for a in trainer_args]],
            cwd=REPO, env={**os.environ, "FTCTL_TOKEN": TOKEN}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.control = ControlPlane.at(f"http://127.0.0.1:{self.port}", TOKEN, timeout=60)

    def wait_training(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = (self.state_dir.parent / f"{self.state_dir.name}-ftctl.log").read_text(errors="replace")
                raise RuntimeError(f"ftctl up exited with {self.proc.returncode}: {tail.strip().splitlines()[-1:]}")
            try:
                if {g["state"] for g in self.control.groups()} == {"training"}:
                    return
            except ApiError:
                pass
            time.sleep(0.5)
        raise TimeoutError("groups did not all reach training")

    def wait_spares_ready(self, groups: list[int], timeout_s: float = 300) -> None:
        """Until these groups' warm spares are ready: a spare still building slows the training
        on the same CPUs, so a measurement started before would not be of the steady state."""
        deadline = time.monotonic() + timeout_s
        while any(self.control.agent_status(g)["spare"] != "ready" for g in groups):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the warm spares of groups {groups} were not ready within {timeout_s:.0f}s")
            time.sleep(1)

    def full_quorum_steps(self, groups: int, warmup: int, steps: int, group: int | None = None) -> list[dict]:
        """Once every group has committed ``warmup + steps`` steps: the rank-0 committed step
        events (of ``group``, or of every group) after the warm-up, of quorums that held all
        ``groups`` groups."""
        while min(g["step"] or 0 for g in self.control.groups()) < warmup + steps:
            time.sleep(1)
        return [e for e in self.control.events(group=group, type="step", limit=1000)
                if e["rank"] == 0 and e["committed"] and e["participants"] == groups and e["step"] > warmup]

    def drill(self, body: dict, poll_s: float = 0.5) -> dict:
        """Start a drill and wait for its report."""
        return self.control.run_drill(body, poll_s)

    def stop(self) -> None:
        """Stop `ftctl up` as Ctrl-C does (it stops its services in order), then whatever is left."""
        try:
            end_tree(self.proc, STOP_GRACE_S)
        finally:
            self.control.close()
            self.log.close()
