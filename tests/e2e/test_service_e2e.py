"""`ftctl up` end to end: real Lighthouse, control plane, agents, torchrun groups, Prometheus, Chromium.

One job serves the module's tests (starting one costs a minute on two cores); each test waits
for the state it needs, so they pass in any order. (Ctrl-C is tests/test_launcher.py's: a second
job beside this one would starve both on two cores.)
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from bench.browser import chromium, quietly
from cluster import REPO, wait_for
from dashboards.quorum import panel_queries
from processes import Owner
from protocol import api
from protocol.tokens import TOKEN_VARIABLES, group_token
from protocol.torchrun import free_port
from service.client import ApiError, ControlPlane
from service.proctree import process_tree
from up_job import (TOKEN, UpJob, all_training, all_training_again, assert_each_sample_once, assert_recovery_adds_up,
                    ftctl, ftctl_up, groups, job_snapshot, json_out)

pytestmark = [pytest.mark.prometheus]

ARTIFACTS = REPO / "test-artifacts"


@dataclass
class Live:
    job: UpJob
    prometheus_url: str

    @property
    def control(self) -> ControlPlane:
        return self.job.control

    @property
    def api(self) -> httpx.Client:
        """Raw requests without the token: the HTTP contract itself."""
        return self.job.api

    @property
    def state(self) -> Path:
        return self.job.state


def prometheus_config(path: Path, conn: dict) -> Path:
    targets = {"controlplane": [conn["api"]], "lighthouse": [conn["lighthouse_api"]], "agents": list(conn["agents"].values())}
    jobs = "".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps([u.split('//')[1] for u in urls])}\n"
        for job, urls in targets.items())
    path.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n"
                    f"  - {REPO / 'deploy/prometheus/rules.yml'}\nscrape_configs:\n{jobs}")
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if not shutil.which("prometheus"):
        pytest.fail("prometheus is not installed: .ci/run installs Debian's prometheus package")
    tmp = tmp_path_factory.mktemp("live")
    with ftctl_up(tmp, "--spares", "1", "--trainer-arg=--checkpoint-every=20") as job, Owner() as owner, \
            open(tmp / "prometheus.log", "wb") as log:
        prom_port = free_port()
        subprocess.Popen(
            ["prometheus", f"--config.file={prometheus_config(tmp / 'prometheus.yml', job.connection())}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            env=owner.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield Live(job, f"http://127.0.0.1:{prom_port}")


def test_rest_kill_and_rejoin_promotes_the_warm_spare(live):
    control = live.control
    all_training_again(control)
    quorum = control.quorum()
    assert quorum["lighthouse_reachable"] and sorted(m["group"] for m in quorum["members"]) == [0, 1]
    assert all(m["state"] == "training" for m in quorum["members"])
    wait_for(lambda: control.agent_status(0)["spare"] == "ready", 240, "group 0's warm spare")

    killed_at = time.time()
    control.kill(0)
    # the agent's own word that it killed the group, not the control plane's view of it
    killed = wait_for(lambda: control.events(group=0, type="process", since=killed_at), 30,
                      "group 0's agent to report the kill")
    assert [(e["action"], e["detail"]) for e in killed] == [("killed", None)]
    assert (groups(control)[0]["state"], groups(control)[0]["down_reason"]) == ("down", "killed")

    def survivor_alone():
        events = control.events(group=1, type="step", since=killed_at, limit=1000)
        return [e for e in events if e["rank"] == 0 and e["committed"] and e["participants"] == 1]

    wait_for(survivor_alone, 60, "group 1 to commit alone")
    with pytest.raises(ApiError) as refused:
        control.kill(0)
    assert refused.value.status == 409

    rejoined = control.rejoin(0)
    assert rejoined["group_state"]["state"] == "starting"
    rejoined_at = time.time()
    wait_for(lambda: groups(control)[0]["state"] == "training"
             and (groups(control)[0]["last_heal"] or {}).get("ts", 0) > rejoined_at,
             240, "group 0 to heal and train again", explain=lambda: job_snapshot(control))
    states = [t["state"] for t in control.group(0)["transitions"]]
    assert states[-5:] == ["down", "starting", "joining", "healing", "training"]
    process = control.events(group=0, type="process", since=killed_at)
    assert [(e["action"], e["detail"]) for e in process] == [("killed", None), ("started", "promoted warm spare (ready)")]
    start = control.events(group=0, type="start", since=rejoined_at - 1)[0]
    assert start["spare_wait_s"] > 0


@pytest.fixture(scope="module")
def kill_heal_drill(live) -> dict:
    """The module's one kill-heal drill, run from the CLI: its report, for every test that needs one."""
    all_training_again(live.control)
    return json_out(ftctl(live.state, "drill", "kill-heal", "--group", "1", "--json"))


def test_kill_heal_drill_from_the_cli_reports_equal_state(live, kill_heal_drill):
    drill = kill_heal_drill
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True
    r = drill["report"]
    assert 0 < r["detect_s"] <= r["survivors_resume_s"] < 30 and r["survivors_steps_lost"] <= 1
    assert r["rejoin_to_healed_commit_s"] > 0 and r["heal_bytes"] > 0
    assert_recovery_adds_up(r)
    assert len({d for ranks in r["fingerprints"].values() for d in ranks.values()}) == 2  # one digest per rank
    status = json_out(ftctl(live.state, "status", "--json"))
    assert status["quorum_id"] >= 1
    assert status["data"]["trained_twice"] == 0 and status["data"]["samples_planned"] > 0, status["data"]
    assert_each_sample_once(live.control)
    hung = live.control.events(type="process", limit=1000)
    assert not [e for e in hung if e["action"] == "hung"], "the watchdog took a checkpoint, heal or promotion for a hang"
    projected = live.control.goodput()  # the ledger projects the drill's recovery
    assert projected["measured"]["drills"] == 1 and len(projected["answer"]) == 2


def test_chaos_drill_measures_goodput(live):
    all_training_again(live.control)
    c = json_out(ftctl(live.state, "drill", "chaos", "--mtbf", "6", "--duration", "20", "--seed", "1",
                       "--rejoin-delay", "2", "--baseline", "8", "--json"))
    assert c["status"] == "done" and c["report"]["kills"], c
    assert 0 < c["goodput"] < 1.2 and c["report"]["baseline_rate"] > 0
    assert set(c["report"]["lost_s"]) == {"detect", "restart", "heal", "rollback", "waiting_to_rejoin"}
    assert all(k["heal_s"] is not None for k in c["report"]["kills"]), "every killed group came back and healed"


@pytest.mark.browser
def test_web_page_kill_and_heal_in_chromium(live, kill_heal_drill):
    from selenium.webdriver.common.by import By

    all_training_again(live.control)
    with chromium() as driver:
        driver.get(str(live.api.base_url))
        card = lambda: driver.find_element(By.ID, "group-1")  # noqa: E731
        wait_for(quietly(lambda: card().get_attribute("data-state") == "training"), 30, "the page to show group 1 training")
        assert "https://" not in driver.page_source.split("<body")[0], "the page loads something from the internet"
        # the groups come first on the page, the drills with the quorum just after
        crash = wait_for(quietly(lambda: driver.find_element(By.CSS_SELECTOR,
                                                             '#fault-classes tr[data-fault="crash"]').text), 10,
                         "the detection by fault class on the page")
        assert crash == f"crash {kill_heal_drill['report']['detect_s']:.2f}s " \
                        f"{kill_heal_drill['report']['survivors_resume_s']:.2f}s", "detection by fault class on the page"
        phases = driver.find_elements(By.CSS_SELECTOR, ".drill .recovery .phase")
        assert {"process_start", "transfer", "first_commit"} <= {p.get_attribute("data-phase") for p in phases}, \
            "the drill's rejoin, phase by phase, on the page"
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        clicked_at = time.time()
        card().find_element(By.CSS_SELECTOR, "button.kill").click()
        wait_for(quietly(lambda: card().get_attribute("data-state") == "down"), 30, "group 1 to show down")
        wait_for(quietly(lambda: not card().find_element(By.CSS_SELECTOR, "button.rejoin").get_attribute("disabled")), 10,
                 "the rejoin button")
        card().find_element(By.CSS_SELECTOR, "button.rejoin").click()
        # back with the survivor: healed from it, or (when the survivor waited at the step it had
        # just checkpointed, for the rejoining group to join) resumed from that checkpoint
        wait_for(quietly(lambda: card().get_attribute("data-state") == "training" and any(
            e["committed"] and e["participants"] == 2 and e["rank"] == 0
            for e in live.control.events(group=1, type="step", since=clicked_at))), 240,
                 "group 1 to come back on the page and train beside group 0",
                 explain=lambda: f"the card says {card().get_attribute('data-state')}\n{job_snapshot(live.control)}")
        caught_up = live.control.events(group=1, type=["heal", "start"], since=clicked_at)
        assert any(e["type"] == "heal" or e.get("resumed_step") for e in caught_up), caught_up
        wait_for(quietly(lambda: "healed at step" in driver.find_element(By.ID, "events").text), 30,
                 "the heal in the timeline")
        assert "last heal: step" in card().text
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "control-plane-page.png"))


def test_prometheus_scrapes_and_every_dashboard_query_returns_data(live, kill_heal_drill):
    """Every panel has data once the job has trained and a drill has measured its recovery."""
    prom = httpx.Client(base_url=live.prometheus_url, timeout=30)

    def targets_up():
        targets = prom.get("/api/v1/targets").json()["data"]["activeTargets"]
        return targets and all(t["health"] == "up" for t in targets)

    def instant(expr: str) -> list:
        body = prom.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def panels_without_data() -> list[tuple[str, str, str]]:
        window = {"start": live.job.started, "end": time.time(), "step": "2s"}
        empty = []
        for title, ref, expr in panel_queries(json.loads((REPO / "dashboards/quorum.json").read_text())):
            body = prom.get("/api/v1/query_range", params={**window, "query": expr.replace("$group", ".*")}).json()
            assert body["status"] == "success", (title, ref, body)
            if not body["data"]["result"]:
                empty.append((title, ref, expr))
        return empty

    wait_for(targets_up, 60, "Prometheus to scrape every process")
    empty, deadline = panels_without_data(), time.monotonic() + 30
    while empty and time.monotonic() < deadline:  # a drill just finished reaches Prometheus at its next scrape
        time.sleep(1)
        empty = panels_without_data()
    assert not empty, f"panels without data: {empty}"
    rules = prom.get("/api/v1/rules").json()["data"]["groups"]
    assert {g["name"] for g in rules} == {"ftctl-recording", "ftctl-alerts"}

    # a kill shows in the group-state and participants series (held down until scraped)
    all_training_again(live.control)
    live.control.kill(1)
    try:
        wait_for(lambda: instant('ftctl_group_state{group="1",state="down"} == 1'), 60,
                 "Prometheus to see group 1 down")
        wait_for(lambda: instant("ftctl_lighthouse_quorum_participants == 1"), 60,
                 "Prometheus to see the quorum shrink to one group")
        wait_for(lambda: instant('ftctl_group_participants{group="0"} == 1'), 60,
                 "Prometheus to see group 0 training alone")
    finally:
        live.control.rejoin(1)
    wait_for(lambda: all_training(live.control), 240, "group 1 back after the kill")
    assert instant('increase(ftctl_group_exits_total{group="1",reason="killed"}[10m]) > 0')


def test_control_plane_restart_keeps_history_and_events_keep_coming(live):
    control = live.control
    tree = {p.pid: p for p in process_tree(live.job.proc.pid)}
    [server] = [p for p in tree.values() if "service.controlplane" in " ".join(p.cmdline())]
    drills_before = control.drills()
    first_event = control.events(limit=1)[0]
    server.kill()
    wait_for(lambda: server.pid not in [p.pid for p in process_tree(live.job.proc.pid)] and groups(control), 60,
             "ftctl up to restart the control plane")
    assert control.drills() == drills_before
    assert control.events(limit=1)[0] == first_event
    restarted_at = time.time()
    wait_for(lambda: control.events(type="step", since=restarted_at), 60, "new events after the control-plane restart")
    # raw: the client's stream waits without a bound, this read gives up after 30 s
    with httpx.stream("GET", f"{live.api.base_url}{api.url(api.EVENTS_STREAM)}", params={"type": "step"},
                      timeout=30) as sse:
        data = next(line for line in sse.iter_lines() if line.startswith("data: "))
        assert json.loads(data[6:])["type"] == "step"


def test_rest_evict_ends_a_group_for_good_and_its_warm_spare_takes_its_place(live):
    """What the straggler policy does to a costly straggler (tests/test_three_groups_e2e.py drills
    it without a spare): the group goes down as evicted and its ready spare is promoted at once."""
    control = live.control
    all_training_again(control)
    wait_for(lambda: control.agent_status(0)["spare"] == "ready", 240, "group 0's warm spare")
    evicted_at = time.time()
    out = control.evict(0)
    assert out["replaced_by_spare"] is True and out["agent"]["action"] == "evict", out
    wait_for(lambda: groups(control)[0]["state"] == "training" and (groups(control)[0]["last_heal"] or {}).get("ts", 0)
             > evicted_at, 240, "the promoted spare to heal and train")
    process = control.events(group=0, type="process", since=evicted_at)
    assert [(e["action"], e["detail"]) for e in process][:2] == [
        ("evicted", "the control plane evicted it; its agent does not restart it"), ("started", "promoted warm spare (ready)")]
    assert 'ftctl_group_exits_total{group="0",reason="evicted"} 1.0' in live.api.get("/metrics").text


def test_only_what_torch_and_torchft_hard_code_listens_beyond_loopback(live):
    """`ftctl up` binds what it controls to 127.0.0.1: the Lighthouse, the control plane, the
    agents, the heal servers, the zygotes (a Unix socket). A group's store (rank 0 hosts it when
    the zygote forked the group, torchrun when it started it) and rank 0's torchft Manager bind
    every interface in torch's and torchft's code; they are the only exceptions (deploy/ keeps
    them on the job's network)."""
    all_training_again(live.control)
    tree = {p.pid: p for p in process_tree(live.job.proc.pid)}
    members = live.control.quorum()["members"]  # with the token: the addresses
    ports = {urlsplit(m["manager_address"]).port for m in members} | {
        int(m["store_address"].rsplit(":", 1)[1]) for m in members}
    wide = [(c.pid, c.laddr) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in tree and not ipaddress.ip_address(c.laddr.ip).is_loopback]
    assert wide, "expected the groups' stores and torchft's Managers"
    for pid, address in wide:
        hard_coded = "torch.distributed.run" in " ".join(tree[pid].cmdline()) or address.port in ports
        assert hard_coded, f"{' '.join(tree[pid].cmdline())[:120]} listens on {address.ip}:{address.port}"


def test_each_process_holds_only_the_token_it_needs(live):
    """The control plane and the wrapper the job's; an agent its group's alone; a rank or the
    torchft Lighthouse none (they run code that reads no token and need not leak one)."""
    all_training_again(live.control)
    for proc in process_tree(live.job.proc.pid)[1:]:
        cmd, env = " ".join(proc.cmdline()), proc.environ()
        tokens = {k: v for k, v in env.items() if k in TOKEN_VARIABLES}
        if "service.controlplane" in cmd or "-m lighthouse" in cmd:
            assert tokens == {"FTCTL_TOKEN": TOKEN}, cmd
        elif "service.agent" in cmd:
            group = int(cmd.split("--group ")[1].split()[0])
            assert tokens == {"FTCTL_AGENT_TOKEN": group_token(TOKEN, group)}, cmd
        else:
            assert tokens == {}, f"{cmd[:100]} holds {sorted(tokens)}"


def test_reads_without_the_token_hide_what_torchfts_kill_paths_need(live):
    all_training_again(live.control)
    # raw, without the token, against the client's read with it
    anonymous, holder = live.api.get(api.url(api.QUORUM)).json(), live.control.quorum()
    assert anonymous["members"] and anonymous["raw"] is None
    assert all(m["replica_id"] is None and m["manager_address"] is None and m["store_address"] is None
               for m in anonymous["members"])
    assert all(h["replica_id"] is None for h in anonymous["heartbeats"])
    assert all(m["replica_id"].startswith(f"group{m['group']}:") for m in holder["members"]) and holder["raw"]
    wrapper = live.job.connection()["lighthouse_api"]
    assert httpx.get(f"{wrapper}/status").status_code == 401, "the wrapper's full view is the token holder's"


def test_a_running_drill_is_cancelled_and_frees_the_groups(live):
    control = live.control
    all_training_again(control)
    drill = control.start_drill({"kind": "straggler", "group": 1, "delay_ms": 50, "duration_s": 600,
                                 "baseline_s": 600})["id"]
    with pytest.raises(ApiError) as refused:
        control.kill(0)
    assert refused.value.status == 409, "a running drill holds the groups"
    cancelled = control.cancel_drill(drill)
    assert cancelled["status"] == "cancelled", cancelled
    assert "cancelled by request" in cancelled["error"]
    with pytest.raises(ApiError) as again:
        control.cancel_drill(drill)
    assert again.value.status == 409
    assert 'ftctl_drills_total{kind="straggler",status="cancelled"} 1.0' in live.api.get("/metrics").text
    killed_at = time.time()
    assert ftctl(live.state, "kill", "1").returncode == 0, "the groups are free again"
    killed = wait_for(lambda: control.events(group=1, type="process", since=killed_at), 30,
                      "group 1's agent to report the kill")
    assert [e["action"] for e in killed] == ["killed"]
    assert groups(control)[1]["state"] == "down"
    control.rejoin(1)
    wait_for(lambda: all_training(control), 240, "group 1 back")
