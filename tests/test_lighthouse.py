"""The Lighthouse JSON view against the real torchft Lighthouse, and the restarting wrapper."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import pytest
from torchft._torchft import LighthouseClient, LighthouseServer

from cluster import REPO, wait_for
from lighthouse.status import StatusFormatError, parse_status
from processes import Owner
from service.proctree import process_tree, wait_gone
from protocol.torchrun import free_port


def _page(server: LighthouseServer) -> str:
    port = server.address().rsplit(":", 1)[1]
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).text


def _join(client: LighthouseClient, group: int, step: int, results: list) -> None:
    results.append(client.quorum(
        replica_id=f"group{group}:uuid-{group}", timeout=timedelta(seconds=10),
        address=f"http://manager{group}:100{group}", store_address=f"store{group}:200{group}",
        step=step, world_size=2,
    ))


@pytest.fixture
def server():
    s = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, quorum_tick_ms=50,
                         heartbeat_timeout_ms=5000)
    yield s
    s.shutdown()


def test_contract_with_zero_one_and_two_members(server):
    empty = parse_status(_page(server))
    assert empty.quorum_id == 0 and empty.members == [] and empty.heartbeats == []
    assert empty.previous_quorum_id is None and "0 heartbeating" in empty.next_quorum.text
    assert empty.next_quorum.heartbeating == 0

    client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
    results: list = []
    _join(client, 0, 7, results)
    one = parse_status(_page(server))
    assert one.quorum_id == results[0].quorum_id == 1
    [member] = one.members
    assert (member.replica_id, member.group, member.step) == ("group0:uuid-0", 0, 7)
    assert (member.manager_address, member.store_address, member.world_size) == ("http://manager0:1000", "store0:2000", 2)
    assert [h.group for h in one.heartbeats] == [0] and one.heartbeats[0].age_s < 5
    assert one.quorum_age_s is not None and one.previous_quorum_id == 1

    # group 1 asks first: were group 0 (the only previous member) first, the Lighthouse would
    # form a fast quorum of group 0 alone before group 1's request arrived
    client.heartbeat("group1:uuid-1")
    threads = [threading.Thread(target=_join, args=(client, g, 8, results)) for g in (1, 0)]
    threads[0].start()
    wait_for(lambda: "only have 1 participants" in parse_status(_page(server)).next_quorum.text, 10,
             "group 1's quorum request to be pending")
    threads[1].start()
    for t in threads:
        t.join(15)
    two = parse_status(_page(server))
    assert two.quorum_id == 2
    assert sorted(m.group for m in two.members) == [0, 1]
    assert {m.step for m in two.members} == {8}
    assert sorted(h.group for h in two.heartbeats) == [0, 1]


def test_a_changed_page_fails_loudly():
    with pytest.raises(StatusFormatError, match="current quorum id"):
        parse_status("<html><body>Lighthouse 9.9: a new page</body></html>")
    page = ("Current quorum_id: 3 <br>\nNext quorum status: ok\n<h3>Previous Quorum</h3>\n"
            "Previous quorum id: 3 <br>\nNum participants: 1 <br>\n<div class='member'>changed</div>\n"
            "<h2>Heartbeats</h2><ul></ul>")
    with pytest.raises(StatusFormatError, match="1 participants but 0 parsed"):
        parse_status(page)


def test_wrapper_serves_json_and_restarts_a_dead_lighthouse():
    port, api = free_port(), free_port()
    owner = Owner()
    wrapper = subprocess.Popen([sys.executable, "-m", "lighthouse", "--bind", f"[::]:{port}", "--api-port", str(api),
                                "--restart-delay-s", "0.2"], cwd=REPO, env=owner.env(), start_new_session=True)
    base = f"http://127.0.0.1:{api}"
    try:
        wait_for(lambda: _healthy(base), 30, "the wrapper to report a healthy Lighthouse")
        status = httpx.get(f"{base}/status").json()
        assert status["quorum_id"] == 0 and status["members"] == []
        first = httpx.get(f"{base}/healthz").json()["pid"]
        process_tree(first)[0].send_signal(signal.SIGKILL)
        wait_for(lambda: _healthy(base) and httpx.get(f"{base}/healthz").json()["pid"] != first, 30,
                 "the wrapper to restart the Lighthouse")
        health = httpx.get(f"{base}/healthz").json()
        assert health["restarts"] == 1
        metrics = httpx.get(f"{base}/metrics").text
        assert "ftctl_lighthouse_restarts_total 1.0" in metrics and "ftctl_lighthouse_up 1.0" in metrics
        pids = [p.pid for p in process_tree(wrapper.pid)]
        assert len(pids) == 2
        wrapper.send_signal(signal.SIGTERM)
        wrapper.wait(15)
        assert not wait_gone(pids, 10), "the Lighthouse outlived its wrapper"
    finally:
        owner.end()


LH_TOKEN = "lighthouse-token-0123456789abcdef"


HOLD_S = 5.0
"""Long enough that the second kill lands inside the hold even on a machine busy with other tests."""


def test_wrapper_kills_the_lighthouse_on_request_and_holds_its_restart():
    port, api = free_port(), free_port()
    owner = Owner()
    wrapper = subprocess.Popen([sys.executable, "-m", "lighthouse", "--bind", f"127.0.0.1:{port}", "--api-port",
                                str(api), "--restart-delay-s", "0.1"], cwd=REPO,
                               env={**owner.env(), "FTCTL_TOKEN": LH_TOKEN}, start_new_session=True)
    base = f"http://127.0.0.1:{api}"
    auth = {"Authorization": f"Bearer {LH_TOKEN}"}
    try:
        wait_for(lambda: _healthy(base), 30, "the wrapper to report a healthy Lighthouse")
        first = httpx.get(f"{base}/healthz").json()["pid"]
        assert httpx.post(f"{base}/kill").status_code == 401
        assert httpx.post(f"{base}/kill", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert httpx.post(f"{base}/kill", json={"down_s": -1}, headers=auth).status_code == 422
        assert first in {p.pid for p in process_tree(wrapper.pid)}, "a refused kill killed something"
        killed = httpx.post(f"{base}/kill", json={"down_s": HOLD_S}, headers=auth).json()
        assert killed["pid"] == first and killed["restart_at"] - killed["killed_at"] == pytest.approx(HOLD_S)
        again = httpx.post(f"{base}/kill", headers=auth)
        assert again.status_code == 409 and "already down" in again.json()["detail"]
        wait_for(lambda: _healthy(base), 30, "the Lighthouse back after its hold")
        back = time.time()
        assert back >= killed["restart_at"], "the wrapper restarted the Lighthouse before the hold ended"
        assert httpx.get(f"{base}/healthz").json()["pid"] != first
    finally:
        owner.end()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).json()["ok"]
    except (httpx.HTTPError, ValueError):
        return False
