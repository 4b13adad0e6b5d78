"""Groups on hosts of their own (network namespaces on a private bridge, ``tests/netns.py``):
real addresses and interfaces, as on a first multi-host job."""

from __future__ import annotations

import socket
import time
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster import committed_steps, read_events, wait_for
from netns import NamespaceHosts, skip_unless_available
from processes import Owner
from protocol import defaults
from protocol.network import is_loopback, resolve

STEPS = 12
SMALL = ["--ranks-per-group", "1", "--seq-len", "64", "--batch-size", "2", "--log-every", "5", "--fingerprint-every", "1"]


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
        port = defaults.LIGHTHOUSE_PORT
        exe = str(Path(sys.executable).with_name("torchft_lighthouse"))
        subprocess.Popen([*h.run(0), exe, "--bind", f"{h.address(0)}:{port}", "--min_replicas", "1",
                          "--join_timeout_ms", str(defaults.JOIN_TIMEOUT_MS), "--quorum_tick_ms",
                          str(defaults.QUORUM_TICK_MS), "--heartbeat_timeout_ms", str(defaults.HEARTBEAT_TIMEOUT_MS)],
                         env={**owner.env(), "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        wait_for(lambda: subprocess.run([*h.run(1), "bash", "-c", f"exec 3<>/dev/tcp/{h.address(0)}/{port}"],
                                        capture_output=True).returncode == 0, 30, "the Lighthouse on host 0")
        yield Hosts(h, f"http://{h.address(0)}:{port}")


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


def together(events_dir: Path, n: int, since: float = 0.0, members=(0, 1, 2)) -> bool:
    """Every one of ``members`` committed ``n`` steps with exactly them since ``since``."""
    events = read_events(events_dir)
    return all(len([e for e in committed_steps(events, g, since=since) if e["participants"] == len(members)]) >= n
               for g in members)


def resumed_s(events_dir: Path, since: float) -> float:
    """From ``since`` to the first step groups 0 and 1 committed as two."""
    return min(e["ts"] for g in (0, 1) for e in committed_steps(read_events(events_dir), g, since=since)
               if e["participants"] == 2) - since


def test_a_group_whose_host_is_cut_off_from_everyone_is_left_out_and_the_others_train_on(hosts, groups, tmp_path):
    """Host 3 loses its link (the Lighthouse included), as a node that drops off the network:
    to the others it is a lost node. Its collectives time out, its heartbeats stop reaching the
    Lighthouse, and the next quorum is the two that can still talk."""
    events_dir = tmp_path / "events"
    train_three(hosts, groups, events_dir)
    cut_at = time.time()
    hosts.net.isolate(3)
    wait_for(lambda: together(events_dir, 3, cut_at, members=(0, 1)), 120, "groups 0 and 1 to commit without group 2")
    print(f"host of group 2 cut off: groups 0 and 1 committed again {resumed_s(events_dir, cut_at):.1f} s later")


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
    print(f"group 2 cut off from the Lighthouse: groups 0 and 1 committed again {resumed_s(events_dir, cut_at):.1f} s "
          f"later; group 2 stopped {exit_event['ts'] - cut_at:.1f} s after the cut")
