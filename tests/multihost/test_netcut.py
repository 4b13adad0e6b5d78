"""The partition drill's cut as an agent makes it on its own host (``service/agent/netcut.py``),
run on a namespace host: blackhole routes that part it from a peer, undone by their timer or by a
successor, and refused in one line where they cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster import REPO, wait_for
from netns import NamespaceHosts, skip_unless_available
from processes import Owner
from protocol.tokens import group_token

pytestmark = [pytest.mark.netns]

REACHES = r"""
import socket


def reaches() -> bool:
    # whether this host reaches `peer` (a global of the script): refused means its host answered
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((peer, 9))
        return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
"""

CUT_ON_HOST = REACHES + r"""
import json, sys, time
from pathlib import Path
from protocol.agent import CutRequest
from service.agent.netcut import CutRefused, RouteCut

peer, state_path = sys.argv[1], Path(sys.argv[2])
lighthouse = f"http://{peer}:29510"

out = {"before": reaches()}
cut = RouteCut(0, state_path, lighthouse, None)
for hosts in (["127.0.0.1"], [sys.argv[3]]):
    try:
        cut.apply(CutRequest(hosts=hosts, seconds=5))
    except CutRefused as err:
        out.setdefault("refused", []).append(str(err))
out["reaches_after_refusals"] = reaches()
state = cut.apply(CutRequest(hosts=[], job_services=True, seconds=1.0))
out["addresses"], out["during"], out["kept"] = state.addresses, reaches(), state_path.exists()
try:
    cut.apply(CutRequest(hosts=[peer], seconds=5))
except CutRefused as err:
    out["twice"] = str(err)
time.sleep(1.5)
out["after_timer"], out["mended"], out["kept_after"] = reaches(), cut.state.mended_at is not None, state_path.exists()
RouteCut(0, state_path, lighthouse, None).apply(CutRequest(hosts=[peer], seconds=600))  # its agent dies now
out["left_behind"] = reaches()
RouteCut(0, state_path, lighthouse, None).undo_predecessors()
out["successor_undid"] = reaches()
print(json.dumps(out))
"""


def on_host(net: NamespaceHosts, i: int, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*net.run(i), *prefix, sys.executable, "-c", CUT_ON_HOST, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_cut_parts_the_host_from_its_peer_until_its_timer_and_a_successor_undoes_a_dead_agents_cut(tmp_path):
    skip_unless_available()
    with NamespaceHosts(2) as net:
        ran = on_host(net, 0, net.address(1), str(tmp_path / "cut.json"), net.address(0))
        assert ran.returncode == 0, ran.stderr
        out = json.loads(ran.stdout)
    assert out["before"] and out["reaches_after_refusals"], "a refused cut changes nothing"
    loopback, own = out["refused"]
    assert "127.0.0.1" in loopback and "cannot be parted by a route" in loopback
    assert net.address(0) in own and "own host" in own
    assert out["addresses"] == [net.address(1)], "job_services: the Lighthouse's host (here the peer)"
    assert not out["during"] and out["kept"]
    assert "cut already" in out["twice"]
    assert out["after_timer"] and out["mended"] and not out["kept_after"], "the timer mends the cut by itself"
    assert not out["left_behind"] and out["successor_undid"]


def test_an_agent_without_cap_net_admin_is_refused_in_one_line_and_nothing_is_cut(tmp_path):
    skip_unless_available()
    with NamespaceHosts(2) as net:
        ran = on_host(net, 0, net.address(1), str(tmp_path / "cut.json"), net.address(0),
                      prefix=("setpriv", "--bounding-set", "-net_admin"))  # root, less that one capability
        assert ran.returncode == 1, ran.stdout + ran.stderr
        assert not (tmp_path / "cut.json").exists()
    refused = [ln for ln in ran.stderr.strip().splitlines() if ln.startswith("service.agent.netcut.CutRefused")]
    assert len(refused) == 1, ran.stderr
    line = refused[0]
    assert "needs CAP_NET_ADMIN" in line and "nothing was cut" in line, line


AGENT_CALLS = REACHES + r"""
import httpx, json, sys
agent, peer, token = sys.argv[1], sys.argv[2], sys.argv[3]
auth = {"Authorization": f"Bearer {token}"}

out = {}
for step in sys.argv[4:]:
    if step == "cut":
        r = httpx.post(f"{agent}/cut", json={"hosts": [peer], "seconds": 600}, headers=auth)
    else:
        r = httpx.delete(f"{agent}/cut", headers=auth)
    out[step] = {"status": r.status_code, "body": r.json(), "reaches": reaches()}
out["reaches"] = reaches()
print(json.dumps(out))
"""


def test_an_agent_mends_its_cut_on_request_and_when_it_stops(tmp_path):
    """``DELETE /cut`` takes the routes away at once; a cut still in place when the agent stops
    (SIGTERM: a drill's job torn down) goes with it."""
    skip_unless_available()
    token = "netcut-token-0123456789abcdef01"
    with NamespaceHosts(2) as net, Owner() as owner:
        address, peer = net.address(0), net.address(1)
        agent = subprocess.Popen(
            [*net.run(0), sys.executable, "-m", "service.agent", "--group", "0", "--groups", "1", "--no-autostart",
             "--host", address, "--port", "29700", "--lighthouse", f"http://{peer}:29510", "--state-dir", str(tmp_path)],
            env=owner.env(FTCTL_TOKEN=token), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        url = f"http://{address}:29700"

        def calls(*steps: str) -> dict:
            ran = subprocess.run([*net.run(0), sys.executable, "-c", AGENT_CALLS, url, peer, group_token(token, 0),
                                  *steps], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert ran.returncode == 0, ran.stderr
            return json.loads(ran.stdout)

        wait_for(lambda: subprocess.run([*net.run(0), "bash", "-c", f"exec 3<>/dev/tcp/{address}/29700"],
                                        capture_output=True).returncode == 0, 60, "the agent on host 0")
        out = calls("cut", "mend")
        assert (out["cut"]["status"], out["cut"]["reaches"]) == (200, False), out
        assert out["cut"]["body"]["addresses"] == [peer] and out["cut"]["body"]["mended_at"] is None
        assert (out["mend"]["status"], out["mend"]["reaches"]) == (200, True) and out["mend"]["body"]["mended_at"]
        assert calls("cut")["cut"]["reaches"] is False
        agent.terminate()
        agent.wait(timeout=60)  # uvicorn ends by the SIGTERM it caught, once shut down
        assert calls()["reaches"], "the stopped agent's cut is gone"
        assert not (tmp_path / "run" / "group0.cut.json").exists()
