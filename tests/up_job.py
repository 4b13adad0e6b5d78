"""`ftctl up` as a subprocess for the end-to-end tests, and the CLI and REST calls that drive it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster import REPO, wait_for
from processes import Owner
from protocol.tokens import group_token
from protocol.torchrun import free_port
from service.client import ApiError, ControlPlane

TOKEN = "e2e-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def agent_auth(group: int) -> dict[str, str]:
    """What a call straight to group ``group``'s agent carries: that group's token, not the job's."""
    return {"Authorization": f"Bearer {group_token(TOKEN, group)}"}


@dataclass
class UpJob:
    proc: subprocess.Popen
    control: ControlPlane
    """The REST API's client, with the job's token: what the tests drive the job with."""
    api: httpx.Client
    """Raw requests without a token: the HTTP contract itself (``/metrics``, the page, what an
    anonymous read reveals)."""
    state: Path
    log: Path
    started: float = field(default_factory=time.time)

    def connection(self) -> dict:
        return json.loads((self.state / "connection.json").read_text())


SMALL = ("--seq-len=64", "--local-batch-size=1", "--trainer-arg=--fingerprint-every=5")
"""The byte-level default, smaller and faster: the e2e tests' usual job."""


@contextmanager
def ftctl_up(tmp: Path, *args: str, groups: int = 2, ranks_per_group: int = 2, steps: int = 100_000,
             job: tuple[str, ...] = SMALL) -> Iterator[UpJob]:
    """`ftctl up` with 2 groups × 2 ranks (unless told) of a small model (``job``: its flags) on free
    ports; every process it started (orphans included) is ended afterwards."""
    port, state, log = free_port(), tmp / "state", tmp / "ftctl-up.log"
    owner = Owner()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "up", "--groups", str(groups), "--ranks-per-group", str(ranks_per_group),
             "--steps", str(steps),
             "--port", str(port), "--lighthouse-port", str(free_port()), "--state-dir", str(state), "--refresh", "0.5",
             *job, *args],
            cwd=REPO, env=owner.env(FTCTL_TOKEN=TOKEN, COLUMNS="150"), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    api, control = httpx.Client(base_url=url, timeout=30), ControlPlane.at(url, TOKEN, timeout=30)
    try:
        wait_for(lambda: (state / "connection.json").exists(), 120, "ftctl up to start its services")
        yield UpJob(proc, control, api, state, log)
    finally:
        owner.end()
        proc.wait()
        control.close()
        api.close()


def groups(control: ControlPlane) -> dict[int, dict]:
    try:
        return {g["group"]: g for g in control.groups()}
    except (ApiError, ValueError):
        return {}


def metric(api: httpx.Client, name: str, **labels: str) -> float:
    """One sample of the control plane's /metrics."""
    for family in text_string_to_metric_families(api.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"no sample {name}{labels} in /metrics")


def assert_each_sample_once(control: ControlPlane) -> dict:
    """With the default --batch-policy constant, whatever the drills did: every sample of the
    global batches committed steps used up was trained exactly once, but for the batches the
    gradient check blamed on the data itself (skipped on purpose: a sample whose gradient is ten
    times the others', which the byte-level default meets now and then)."""
    data = control.data()
    sdc = control.events(type="sdc", limit=1000)
    blamed = {e["step"] for e in sdc if e["verdict"] == "data"}
    assert data["samples_planned"] > 0 and data["job"]["batch_policy"] == "constant", data
    skipped = len(blamed) * data["job"]["global_batch_size"]
    assert (data["trained_once"], data["trained_twice"], data["skipped"]) == (
        data["samples_planned"] - skipped, 0, skipped), (data, blamed)
    return data


def all_training(control: ControlPlane) -> bool:
    return {g["state"] for g in groups(control).values()} == {"training"}


def all_training_again(control: ControlPlane, timeout_s: float = 240) -> None:
    """Wait until every group trains, rejoining first any group an earlier test, or the hang
    watchdog, left down: the tests of a module share one job and each needs every group up."""
    for g, view in groups(control).items():
        if view["state"] == "down":
            try:
                control.rejoin(g)
            except ApiError:
                pass  # as before: a refused rejoin (a drill holds the groups) shows in the wait below
    wait_for(lambda: all_training(control), timeout_s, "every group training",
             explain=lambda: job_snapshot(control))


def job_snapshot(control: ControlPlane, events: int = 12) -> str:
    """The groups and the job's last notable events, one line each: what a timed-out wait saw."""
    lines = [f"group {g}: {v['state']} step {v['step']} restarts {v['restarts']} down_reason {v['down_reason']}"
             for g, v in groups(control).items()]
    try:
        page = control.events(type=["process", "start", "heal", "quorum", "exit"], since=time.time() - 300,
                              limit=1000)
    except (ApiError, ValueError, KeyError) as e:
        page = [{"error": repr(e)}]
    lines += [json.dumps({k: v for k, v in e.items() if v not in (None, [], {})}, default=str)[:300]
              for e in page[-events:]]
    return "\n".join(lines)


def assert_recovery_adds_up(report: dict) -> None:
    """A kill-heal report's rejoin, phase by phase, from the start to the first commit after a
    heal from a live peer, adds up to the rejoin's whole time within 5%."""
    phases = {p["phase"]: p for p in report["recovery"]}
    assert {"process_start", "manager", "quorum_wait", "transfer", "apply", "first_commit"} <= set(phases), phases
    counted = sum(p["seconds"] for p in report["recovery"] if p["within"] is None)
    assert abs(counted - report["rejoin_to_healed_commit_s"]) <= 0.05 * report["rejoin_to_healed_commit_s"], report
    assert phases["verify"]["within"] == "transfer" and all(p["seconds"] > -0.05 for p in phases.values()), phases


def ftctl(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args, "--state-dir", str(state)], cwd=REPO,
                          capture_output=True, text=True, timeout=400, env={**os.environ, "COLUMNS": "150"})


def json_out(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout[result.stdout.index("{"):])
