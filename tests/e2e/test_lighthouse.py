"""The Lighthouse JSON view against the real torchft Lighthouse, and the restarting wrapper."""

from __future__ import annotations

import asyncio
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
from protocol.lighthouse_status import StatusFormatError, parse_status
from processes import Owner
from service.controlplane.lighthouse import LighthouseClient as LighthouseStatusClient
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


def test_a_restarted_replicas_old_entry_stays_on_the_lighthouse_stale_and_not_heartbeating():
    """torchft 0.2.0 never drops a heartbeat entry: each restart (a new replica id) adds one for
    good (the README's scale section); the view marks the silent ones stale and counts only the rest."""
    s = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50,
                         heartbeat_timeout_ms=300)
    try:
        client = LighthouseClient(s.address(), connect_timeout=timedelta(seconds=5))
        for replica_id in ("group0:before-restart", "group1:uuid-1"):
            client.heartbeat(replica_id, timedelta(seconds=1))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            client.heartbeat("group0:after-restart", timedelta(seconds=1))
            time.sleep(0.05)
        view = parse_status(_page(s))
        assert {h.replica_id: h.stale for h in view.heartbeats} == {
            "group0:before-restart": True, "group1:uuid-1": True, "group0:after-restart": False}
        assert view.next_quorum.heartbeating == 1
    finally:
        s.shutdown()


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


def test_the_control_planes_quorum_view_asks_the_wrapper_once_for_every_viewer_meanwhile():
    port, api = free_port(), free_port()
    owner = Owner()
    subprocess.Popen([sys.executable, "-m", "lighthouse", "--bind", f"127.0.0.1:{port}", "--api-port", str(api)],
                     cwd=REPO, env=owner.env(), start_new_session=True)
    base = f"http://127.0.0.1:{api}"

    async def views() -> tuple[int, int, int]:
        client = LighthouseStatusClient(base, 5.0, LH_TOKEN)
        asked: list[str] = []

        async def count(request: httpx.Request) -> None:
            asked.append(request.url.path)

        client.client.event_hooks["request"].append(count)
        try:
            together = await asyncio.gather(*(client.recent_status(max_age_s=2.0) for _ in range(20)))
            assert all(v == together[0] for v in together) and together[0].quorum_id == 0
            first = len(asked)
            await client.recent_status(max_age_s=2.0)
            cached = len(asked)
            await asyncio.sleep(2.1)
            await client.recent_status(max_age_s=2.0)
            await client.status()
            return first, cached, len(asked)
        finally:
            await client.aclose()

    try:
        wait_for(lambda: _healthy(base), 30, "the wrapper to report a healthy Lighthouse")
        assert asyncio.run(views()) == (1, 1, 3), "20 viewers at once, one more within the age, one after it, one fresh"
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
