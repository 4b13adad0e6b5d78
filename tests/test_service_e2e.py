"""`ftctl up` end to end: real Lighthouse, control plane, agents and torchrun groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from cluster import REPO, wait_for
from service.proctree import process_tree, wait_gone
from trainer.launch import free_port

TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def ftctl_up(tmp_path):
    port = free_port()
    state = tmp_path / "state"
    log = open(tmp_path / "ftctl-up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "up", "--groups", "2", "--nproc-per-group", "2", "--steps", "100000",
         "--port", str(port), "--lighthouse-port", str(free_port()), "--state-dir", str(state), "--refresh", "0.5",
         "--spares", "1",
         "--trainer-arg=--seq-len=64", "--trainer-arg=--batch-size=2", "--trainer-arg=--fingerprint-every=5"],
        cwd=REPO, env={**os.environ, "FTCTL_TOKEN": TOKEN, "COLUMNS": "150"}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    yield proc, api, state, tmp_path / "ftctl-up.log"
    if proc.poll() is None:
        for p in process_tree(proc.pid)[::-1]:
            p.kill()
    proc.wait(30)
    api.close()


def groups(api: httpx.Client) -> dict[int, dict]:
    try:
        return {g["group"]: g for g in api.get("/api/v1/groups").json()}
    except httpx.HTTPError:
        return {}


def ftctl(state, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args, "--state-dir", str(state)], cwd=REPO,
                          capture_output=True, text=True, timeout=400, env={**os.environ, "COLUMNS": "150"})


def agent_status(api: httpx.Client, group: int) -> dict:
    return api.get(f"/api/v1/groups/{group}/agent").json()


def test_up_kill_rejoin_drill_control_plane_restart_and_ctrl_c(ftctl_up):
    proc, api, state, log = ftctl_up
    wait_for(lambda: {g["state"] for g in groups(api).values()} == {"training"}, 240, "both groups training")
    quorum = api.get("/api/v1/quorum").json()
    assert quorum["lighthouse_reachable"] and sorted(m["group"] for m in quorum["members"]) == [0, 1]
    assert all(m["state"] == "training" for m in quorum["members"])
    wait_for(lambda: agent_status(api, 0)["spare"] == "ready", 240, "group 0's warm spare to be ready")

    # group 0 has a warm spare: kill it, then rejoin promotes the spare
    killed = api.post("/api/v1/groups/0/kill", headers=AUTH)
    assert killed.status_code == 200, killed.text
    assert killed.json()["group_state"]["state"] == "down"
    killed_at = time.time()
    survivor_commit = lambda: [e for e in api.get("/api/v1/events", params={  # noqa: E731
        "group": 1, "type": "step", "since": killed_at, "limit": 1000}).json()["events"]
        if e["rank"] == 0 and e["committed"] and e["participants"] == 1]
    wait_for(survivor_commit, 60, "group 1 to commit alone")
    assert api.post("/api/v1/groups/0/kill", headers=AUTH).status_code == 409

    rejoined = api.post("/api/v1/groups/0/rejoin", headers=AUTH)
    assert rejoined.status_code == 200 and rejoined.json()["group_state"]["state"] == "starting"
    rejoined_at = time.time()
    wait_for(lambda: groups(api)[0]["state"] == "training" and (groups(api)[0]["last_heal"] or {}).get("ts", 0) > rejoined_at,
             240, "group 0 to heal and train again")
    states = [t["state"] for t in api.get("/api/v1/groups/0").json()["transitions"]]
    assert states[-5:] == ["down", "starting", "joining", "healing", "training"]
    started = api.get("/api/v1/events", params={"group": 0, "type": "process", "since": rejoined_at - 1}).json()["events"]
    assert started[0]["action"] == "started" and started[0]["detail"] == "promoted warm spare (ready)"
    start_event = api.get("/api/v1/events", params={"group": 0, "type": "start", "since": rejoined_at - 1}).json()["events"][0]
    assert start_event["spare_wait_s"] > 0

    drill = ftctl(state, "drill", "kill-heal", "--group", "1", "--json")
    assert drill.returncode == 0, drill.stdout + drill.stderr
    report = json.loads(drill.stdout[drill.stdout.index("{"):])
    assert report["status"] == "done" and report["fingerprints_equal"] is True
    r = report["report"]
    assert 0 < r["detect_s"] <= r["survivors_resume_s"] < 30 and r["survivors_steps_lost"] <= 1
    assert r["rejoin_to_healed_commit_s"] > 0 and r["heal_bytes"] > 0
    assert len({d for ranks in r["fingerprints"].values() for d in ranks.values()}) == 2  # one digest per rank

    chaos = ftctl(state, "drill", "chaos", "--mtbf", "6", "--duration", "20", "--seed", "1", "--rejoin-delay", "2",
                  "--baseline", "8", "--json")
    assert chaos.returncode == 0, chaos.stdout + chaos.stderr
    c = json.loads(chaos.stdout[chaos.stdout.index("{"):])
    assert c["status"] == "done" and c["report"]["kills"], c
    assert 0 < c["goodput"] < 1.2 and c["report"]["baseline_rate"] > 0
    assert set(c["report"]["lost_s"]) == {"detect", "restart", "heal", "rollback", "waiting_to_rejoin"}
    assert all(k["heal_s"] is not None for k in c["report"]["kills"]), "every killed group came back and healed"
    wait_for(lambda: {g["state"] for g in groups(api).values()} == {"training"}, 240, "both groups training after chaos")
    projected = api.get("/api/v1/goodput").json()
    assert projected["measured"]["drills"] == 1 and len(projected["answer"]) == 2

    status = ftctl(state, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["quorum_id"] >= 1

    tree = {p.pid: p for p in process_tree(proc.pid)}
    [control] = [p for p in tree.values() if "service.controlplane" in " ".join(p.cmdline())]
    last_id = api.get("/api/v1/events", params={"limit": 1000, "after_id": 0}).json()
    control.kill()
    wait_for(lambda: control.pid not in [p.pid for p in process_tree(proc.pid)] and groups(api), 60,
             "ftctl up to restart the control plane")
    assert api.get(f"/api/v1/drills/{report['id']}").json()["fingerprints_equal"] is True
    assert api.get("/api/v1/events", params={"limit": 1}).json()["events"][0]["id"] == last_id["events"][0]["id"]
    newest = lambda: api.get("/api/v1/events", params={"type": "step", "since": time.time() - 2}).json()["events"]  # noqa: E731
    wait_for(newest, 60, "new events after the control-plane restart")

    with httpx.stream("GET", f"{api.base_url}/api/v1/events/stream", params={"type": "step"}, timeout=30) as sse:
        data = next(line for line in sse.iter_lines() if line.startswith("data: "))
        assert json.loads(data[6:])["type"] == "step"

    everything = [p.pid for p in process_tree(proc.pid)]
    assert len(everything) >= 10  # ftctl, lighthouse x2, control plane, 2 agents, 2 torchrun, 4 ranks
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0, log.read_text()[-3000:]
    assert not wait_gone(everything, 10), "processes left behind after Ctrl-C"
    assert "no process left behind" in log.read_text()
