"""Groups on hosts of their own (network namespaces on a private bridge, ``tests/netns.py``):
real addresses and interfaces, as on a first multi-host job."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from cluster import REPO, committed_steps, lighthouse_on_host, read_events, resumed_s, stored, together, wait_for
from netns import NamespaceHosts, skip_unless_available
from processes import Owner
from protocol.layout import GroupLayout
from protocol.beacon import Beacon, read_beacon
from protocol.network import is_loopback, resolve

pytestmark = [pytest.mark.netns]

STEPS = 12
JOB_TOKEN = "multihost-token-0123456789abcdef"
RESUME_S = 3.0
"""Survivors of a cut commit again within this (trainer/collective_watch.py), not a collective timeout."""
SMALL = ["--ranks-per-group", "1", "--seq-len", "64", "--local-batch-size", "2", "--log-every", "5", "--fingerprint-every", "1"]


@dataclass
class Hosts:
    net: NamespaceHosts
    lighthouse: str

    def address(self, i: int) -> str:
        return self.net.address(i)

    def run(self, i: int) -> list[str]:
        return self.net.run(i)


@pytest.fixture
def hosts():
    """Four hosts: the Lighthouse on host 0 (10.77.0.1), a group on each of the others."""
    skip_unless_available()
    with NamespaceHosts(4) as h, Owner() as owner:  # its processes end before the namespaces go
        yield Hosts(h, lighthouse_on_host(h, 0, owner))


def fingerprints(events: list[dict], group: int) -> dict[int, str]:
    return {e["step"]: e["digest"] for e in events if e["type"] == "fingerprint" and e["group"] == group}


def test_three_groups_on_three_hosts_train_together_and_agree_bitwise(hosts, groups, tmp_path):
    events_dir = tmp_path / "events"
    args = ["--lighthouse", hosts.lighthouse, "--groups", "3", "--steps", str(STEPS), "--events-dir", str(events_dir),
            *SMALL]
    started = [groups(g, [*args, "--advertise-host", hosts.address(g + 1)], host=hosts.run(g + 1)).start()
               for g in range(3)]
    for g in started:
        assert g.proc.wait(timeout=300) == 0, g.output()
    events = read_events(events_dir)
    for g in range(3):
        together = [e for e in committed_steps(events, g) if e["participants"] == 3]
        assert len(together) >= STEPS // 2, f"group {g} committed {len(together)} steps with all three"
    prints = [fingerprints(events, g) for g in range(3)]
    common = set(prints[0]) & set(prints[1]) & set(prints[2])
    assert common and all(prints[0][s] == prints[1][s] == prints[2][s] for s in common), "the hosts' states differ"


def test_a_group_advertising_loopback_to_a_lighthouse_on_another_host_is_refused_in_one_line(hosts, groups, tmp_path):
    """The hostname of a stock Debian host resolves to loopback: without --advertise-host the
    others would dial 127.0.0.1 and fail in a collective, naming neither mistake."""
    if not is_loopback(resolve(socket.gethostname())):
        pytest.skip(f"this host's name {socket.gethostname()} does not resolve to a loopback address")
    g = groups(0, ["--lighthouse", hosts.lighthouse, "--events-dir", str(tmp_path / "events"), *SMALL],
               host=hosts.run(1)).start()
    assert g.proc.wait(timeout=120) == 2, g.output()
    [line] = g.output().strip().splitlines()
    assert line.startswith("trainer: error: this group would advertise") and hosts.address(1) in line, line


def train_three(hosts: Hosts, groups, events_dir: Path, *extra: str) -> list:
    """Three groups on hosts 1 to 3, training until stopped, once all three commit together."""
    args = ["--lighthouse", hosts.lighthouse, "--groups", "3", "--steps", "10000", "--events-dir", str(events_dir),
            *SMALL, *extra]
    started = [groups(g, [*args, "--advertise-host", hosts.address(g + 1)], host=hosts.run(g + 1)).start()
               for g in range(3)]
    wait_for(lambda: together(events_dir, 3), 240, "three groups on three hosts committing together")
    return started


def test_a_group_cut_off_from_the_lighthouse_alone_stops_saying_why_and_the_others_train_on(hosts, groups, tmp_path):
    """Host 3 still reaches the other groups but not the Lighthouse's host: its heartbeats stop,
    the others' next quorum leaves it out, and it stops after --quorum-timeout-s with the reason."""
    events_dir = tmp_path / "events"
    third = train_three(hosts, groups, events_dir, "--quorum-timeout-s", "4")[2]
    cut_at = time.time()
    hosts.net.cut(0, 3)
    wait_for(lambda: together(events_dir, 3, cut_at, members=(0, 1)), 120, "groups 0 and 1 to commit without group 2")
    third.proc.wait(timeout=120)
    [exit_event] = [e for e in read_events(events_dir, 2) if e["type"] == "exit" and e["rank"] == 0]
    assert exit_event["reason"] == "lighthouse-away" and "takes no connection" in exit_event["error"], exit_event
    resumed = resumed_s(events_dir, cut_at)
    assert resumed <= RESUME_S, f"the Lighthouse stopped hearing group 2: the others waited {resumed:.1f} s"
    print(f"group 2 cut off from the Lighthouse: groups 0 and 1 committed again {resumed:.1f} s "
          f"later; group 2 stopped {exit_event['ts'] - cut_at:.1f} s after the cut")


def test_two_groups_cut_apart_without_a_control_plane_the_higher_stays_out_and_heals_once_mended(hosts, groups, tmp_path):
    """Hosts 2 and 3 (groups 1 and 2) stop reaching each other; all three still reach the
    Lighthouse, and nobody evicts anything. Each of the pair finds the other's host unreachable
    inside the all-reduce and ends it; group 2, the higher number, stays out of the next quorums
    while it cannot reach group 1, so groups 0 and 1 train on within seconds. Mended: group 2
    rejoins by itself, heals from a live peer and agrees with the others bitwise."""
    events_dir = tmp_path / "events"
    started = train_three(hosts, groups, events_dir)
    cut_at = time.time()
    hosts.net.cut(2, 3)
    wait_for(lambda: together(events_dir, 3, cut_at, members=(0, 1)), 120, "groups 0 and 1 to commit without group 2")
    resumed = resumed_s(events_dir, cut_at)
    time.sleep(max(0.0, cut_at + 8 - time.time()))
    mended_at = time.time()
    hosts.net.mend(2, 3)
    wait_for(lambda: together(events_dir, 3, mended_at), 120, "group 2 back with the others")
    events = read_events(events_dir)
    failed = [e for e in events if e["type"] == "commit_failed" and cut_at <= e["ts"] < mended_at]
    assert any("took no connection" in (e["error"] or "") for e in failed), "a collective ended on the evidence"
    assert "staying out of the next quorum: group 1 takes no connection" in started[2].output()
    heal = [e for e in events if e["type"] == "heal" and e["group"] == 2 and e["ts"] >= mended_at][0]
    assert heal["source_group"] in (0, 1)
    after = [{s: d for s, d in fingerprints(events, g).items() if s > heal["step"]} for g in range(3)]
    common = set(after[0]) & set(after[1]) & set(after[2])
    assert common and all(after[0][s] == after[1][s] == after[2][s] for s in common), "group 2 differs after its heal"
    assert resumed <= RESUME_S, f"groups 0 and 1 waited {resumed:.1f} s"
    print(f"groups 1 and 2 cut apart, no control plane: groups 0 and 1 committed again {resumed:.1f} s later; mended, "
          f"group 2 healed {heal['ts'] - mended_at:.1f} s after")


def agent_on_host(hosts: Hosts, owner: Owner, group: int, state_dir: Path, *agent_args: str,
                  trainer_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Group ``group``'s agent on host ``group + 1``, as a node of a multi-host job runs it."""
    address = hosts.address(group + 1)
    trainer = ["--steps", "10000", *SMALL[2:], *trainer_args]
    return subprocess.Popen(
        [*hosts.run(group + 1), sys.executable, "-m", "service.agent", "--group", str(group), "--groups", "3",
         "--ranks-per-group", "1", "--lighthouse", hosts.lighthouse, "--host", address, "--advertise-host", address,
         "--state-dir", str(state_dir), "--trainer-args", json.dumps(trainer), *agent_args],
        env=owner.env(FTCTL_TOKEN=JOB_TOKEN, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO)


def restarted_alone(events_dir: Path, cut_off: Beacon) -> bool:
    """Whether group 2's trainer is another than ``cut_off`` now; if so, ``cut_off`` has ended."""
    now = read_beacon(events_dir / GroupLayout(2).beacon(0))
    restarted = now is not None and now.pid != cut_off.pid
    if restarted:
        assert not psutil.pid_exists(cut_off.pid) or psutil.Process(cut_off.pid).status() == psutil.STATUS_ZOMBIE, \
            "the trainer that was cut off still runs beside its successor"
    return restarted


def test_a_group_whose_cable_is_pulled_is_left_out_and_comes_back_once_it_is_back_and_heals_bitwise(hosts, tmp_path):
    """Host 3 loses its link (the Lighthouse included), its agent with it, as a node that drops
    off the network: to the others it is a lost node. Its collectives time out, its heartbeats
    stop reaching the Lighthouse, and the next quorum is the two that can still talk. Group 2's
    trainer waits for a quorum (torchft retries the unreachable Lighthouse; once it gives up,
    after --quorum-timeout-s at the least, the trainer stops and its agent waits for the
    Lighthouse before starting it again). Cable back: group 2 rejoins, heals from a live peer and agrees
    with the others bitwise, and never runs two trainers at once."""
    events_dir = tmp_path / "events"
    with Owner() as owner:
        for g in range(3):
            agent_on_host(hosts, owner, g, tmp_path, trainer_args=("--quorum-timeout-s", "4"))
        wait_for(lambda: together(events_dir, 3), 300, "three agents' groups on three hosts committing together")
        cut_off = read_beacon(events_dir / GroupLayout(2).beacon(0))
        assert cut_off is not None
        cut_at = time.time()
        hosts.net.isolate(3)
        wait_for(lambda: together(events_dir, 3, cut_at, members=(0, 1)), 120, "groups 0 and 1 to commit without group 2")
        resumed = resumed_s(events_dir, cut_at)
        assert resumed <= RESUME_S, f"groups 0 and 1 waited {resumed:.1f} s"
        time.sleep(max(0.0, cut_at + 15 - time.time()))  # past the collective and the quorum timeouts
        healed_at = time.time()
        hosts.net.reconnect(3)
        wait_for(lambda: together(events_dir, 3, healed_at), 180, "group 2 back with the others")
        events = read_events(events_dir)
        heals = [e for e in events if e["type"] == "heal" and e["group"] == 2 and e["ts"] >= healed_at]
        assert heals and heals[0]["source_group"] in (0, 1), "group 2 healed from a live peer"
        after = [{s: d for s, d in fingerprints(events, g).items() if s > heals[0]["step"]} for g in range(3)]
        common = set(after[0]) & set(after[1]) & set(after[2])
        assert common and all(after[0][s] == after[1][s] == after[2][s] for s in common), "group 2 differs after its heal"
        restarted = restarted_alone(events_dir, cut_off)
        stopped = [e for e in events if e["type"] == "exit" and e["group"] == 2 and e["ts"] >= cut_at]
        print(f"host of group 2 cut off: groups 0 and 1 committed again {resumed:.1f} s later")
        print(f"group 2 cut off for {healed_at - cut_at:.0f} s: "
              + (f"its trainer stopped {stopped[0]['ts'] - cut_at:.1f} s after the cut ({stopped[0]['reason']}) and its "
                 "agent started it again" if restarted and stopped else "its trainer waited for a quorum through it")
              + f"; back {heals[0]['ts'] - healed_at:.1f} s after the cable, healed {heals[0]['bytes']} bytes from "
                f"group {heals[0]['source_group']}")


COLLECTIVE_TIMEOUT_S = 10.0  # the trainers' --timeout-s default
CONTROL_PLANE_PORT = 29600
AGENT_PORT = 29700


def control_plane_on_host_0(hosts: Hosts, owner: Owner, state_dir: Path) -> str:
    """The supervised Lighthouse's wrapper is not needed here: the control plane, on host 0 beside
    the Lighthouse, reaches every agent; its URL."""
    address = hosts.address(0)
    subprocess.Popen([*hosts.run(0), sys.executable, "-m", "service.controlplane", "--host", address,
                      "--port", str(CONTROL_PLANE_PORT), "--db", str(state_dir / "control.db"), "--groups", "3",
                      "--ranks-per-group", "1"],
                     env=owner.env(FTCTL_TOKEN=JOB_TOKEN), stdout=open(state_dir / "controlplane.log", "ab"),
                     stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    url = f"http://{address}:{CONTROL_PLANE_PORT}"
    wait_for(lambda: subprocess.run([*hosts.run(0), "bash", "-c", f"exec 3<>/dev/tcp/{address}/{CONTROL_PLANE_PORT}"],
                                    capture_output=True).returncode == 0, 60, "the control plane on host 0")
    return url


def fetched_on(hosts: Hosts, i: int, url: str) -> str:
    """GET ``url`` from host ``i``, as a Prometheus there would scrape it."""
    got = subprocess.run([*hosts.run(i), sys.executable, "-c", "import httpx, sys; "
                          "print(httpx.get(sys.argv[1], timeout=10).raise_for_status().text)", url],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


def ftctl_on_host_0(hosts: Hosts, api: str, *args: str) -> dict:
    """``ftctl *args --json`` run where the control plane is; the drill it printed."""
    ran = subprocess.run([*hosts.run(0), sys.executable, "-m", "service.cli", *args, "--api", api, "--token", JOB_TOKEN,
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return json.loads(ran.stdout[ran.stdout.index("{"):])


def three_agents(hosts: Hosts, owner: Owner, state_dir: Path, *agent_args: str, trainer_args: tuple[str, ...] = ()) -> str:
    """The control plane on host 0 and three agents' groups on hosts 1 to 3, committing together; its URL."""
    api = control_plane_on_host_0(hosts, owner, state_dir)
    for g in range(3):
        agent_on_host(hosts, owner, g, state_dir, "--control-plane", api, "--port", str(AGENT_PORT), *agent_args,
                      trainer_args=trainer_args)
    wait_for(lambda: together(state_dir / "events", 3), 300, "three agents' groups on three hosts committing together")
    return api


def healed_from_a_live_peer(events_dir: Path, group: int, since: float) -> dict:
    heals = [e for e in read_events(events_dir, group) if e["type"] == "heal" and e["ts"] >= since]
    assert heals and heals[0]["source_group"] != group, f"group {group} healed from a live peer"
    return heals[0]


CANCEL_ONCE_CUT = """
import json, sys, time
from service.client import ControlPlane
with ControlPlane.at(sys.argv[1], sys.argv[2]) as control:
    drill = control.start_drill(json.loads(sys.argv[3]))
    while control.drill(drill["id"])["report"]["phase"] in ("starting", "cut"):
        time.sleep(0.05)
    print(json.dumps(control.cancel_drill(drill["id"])))
"""


def cancelled_once_cut(hosts: Hosts, api: str, pair: list[int]) -> dict:
    """A 10-minute partition drill of ``pair``, cancelled once its cut is made; the drill as cancelled."""
    body = json.dumps({"kind": "partition", "cut": pair, "duration_s": 600})
    ran = subprocess.run([*hosts.run(0), sys.executable, "-c", CANCEL_ONCE_CUT, api, JOB_TOKEN, body], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def test_a_partition_drill_cutting_two_groups_evicts_the_rules_loser_and_it_rejoins_once_mended(hosts, tmp_path):
    """``ftctl drill partition --cut 1,2``: the agents of groups 1 and 2 (hosts 2 and 3) route
    each other's host away; both still reach the Lighthouse and group 0. Without help every
    quorum takes all three back and every commit fails. The control plane probes, keeps {0, 1}
    (the largest set that all reach each other, the lowest numbers first) and evicts group 2;
    groups 0 and 1 commit again. The agents mend the cut after its duration: group 2 rejoins and
    heals from a live peer, bitwise. A second drill, cancelled once its cut is made, mends it."""
    with Owner() as owner:
        api = three_agents(hosts, owner, tmp_path)
        drill = ftctl_on_host_0(hosts, api, "drill", "partition", "--cut", "1,2", "--duration", "15")
        r = drill["report"]
        assert (drill["status"], drill["kind"], drill["fingerprints_equal"]) == ("done", "partition", True), drill
        assert (r["group"], r["evicted"], r["kept"], r["rejoined_by"]) == (2, [2], [0, 1], "control-plane"), r
        assert r["addresses"] == {"1": hosts.address(3), "2": hosts.address(2)}
        assert r["survivors_resume_s"] <= RESUME_S, f"the loop took {r['survivors_resume_s']:.1f} s to break"
        heal = healed_from_a_live_peer(tmp_path / "events", 2, r["mended_at"])
        [evicted, rejoined] = stored(tmp_path / "control.db", "partition")
        assert (evicted["action"], evicted["unreached"], rejoined["action"]) == ("evicted", [1], "rejoined")
        scraped = fetched_on(hosts, 0, f"{api}/metrics")
        assert 'ftctl_partition_actions_total{action="evicted"} 1.0' in scraped
        assert 'ftctl_partition_actions_total{action="rejoined"} 1.0' in scraped
        agent_metrics = fetched_on(hosts, 0, f"http://{hosts.address(3)}:{AGENT_PORT}/metrics")
        assert "ftctl_agent_group_starts_total" in agent_metrics, "group 2's agent scraped from host 0"
        cancelled = cancelled_once_cut(hosts, api, [0, 1])
        assert cancelled["status"] == "cancelled", cancelled
        for g in (0, 1):
            cut = json.loads(fetched_on(hosts, 0, f"http://{hosts.address(g + 1)}:{AGENT_PORT}/status"))["cut"]
            assert cut["at"] >= cancelled["created"] and cut["mended_at"] is not None, "a cancelled drill mends its cut"
        print(f"groups 1 and 2 cut for 15 s: group 2 evicted {r['cut_to_verdict_s']:.1f} s after the cut, groups 0 "
              f"and 1 committed again {r['survivors_resume_s']:.1f} s after it (collective timeout "
              f"{COLLECTIVE_TIMEOUT_S:g} s); mended: group 2 rejoined {rejoined['ts'] - r['mended_at']:.1f} s, healed "
              f"{heal['ts'] - r['mended_at']:.1f} s and committed {r['mend_to_healed_commit_s']:.1f} s after")


def test_an_isolate_drill_leaves_the_group_out_and_it_comes_back_once_the_network_heals_bitwise(hosts, tmp_path):
    """``ftctl drill partition --isolate 2``: host 3 routes away the Lighthouse, the control plane
    and the other groups, as a node that drops off the network: to the others a lost node. Their
    collectives time out, its heartbeats stop, the next quorum is the two that still talk; the
    control plane evicts nobody (its agent answers no probe). Group 2's trainer waits for a
    quorum through the cut (--quorum-timeout-s 60; the cable-pull test above takes the path where
    it gives up and its agent starts it again). Cut mended: it rejoins by itself (the drill says
    ``network``), heals from a live peer and agrees with the others bitwise."""
    events_dir = tmp_path / "events"
    with Owner() as owner:
        api = three_agents(hosts, owner, tmp_path, trainer_args=("--quorum-timeout-s", "60"))
        cut_off = read_beacon(events_dir / GroupLayout(2).beacon(0))
        assert cut_off is not None
        drill = ftctl_on_host_0(hosts, api, "drill", "partition", "--isolate", "2", "--duration", "15")
        r = drill["report"]
        assert (drill["status"], drill["fingerprints_equal"], r["group"], r["evicted"]) == ("done", True, 2, []), drill
        assert set(r["addresses"]["2"].split(", ")) == {hosts.address(i) for i in range(3)}, r["addresses"]
        assert r["survivors_resume_s"] <= RESUME_S, r["survivors_resume_s"]
        assert r["rejoined_by"] == "network", r["rejoined_by"]
        heal = healed_from_a_live_peer(events_dir, 2, r["mended_at"])
        assert not restarted_alone(events_dir, cut_off), "the same trainer came back"
        print(f"host of group 2 cut off: groups 0 and 1 committed again {r['survivors_resume_s']:.1f} s later; its "
              f"trainer waited through it, back {heal['ts'] - r['mended_at']:.1f} s after the cut mended, healed "
              f"{heal['bytes']} bytes from group {heal['source_group']}, committed {r['mend_to_healed_commit_s']:.1f} s "
              "after")
