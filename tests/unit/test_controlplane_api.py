"""The control plane's REST API through FastAPI's TestClient, over a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from bench.events import start_fields, step_fields
from protocol.events import parse_event
from protocol.registration import agent_path
from protocol.tokens import group_token
from cluster import wait_for
from service.agent.app import create_app as agent_app
from service.agent.config import AgentSettings
from protocol.ingest import IngestBatch
from service.controlplane.app import build_services, create_app
from service.controlplane.errors import Overloaded
from service.controlplane.ingest import IngestWriter
from service.controlplane.db import MIGRATIONS, SCHEMA_VERSION, SchemaTooNew, Store
from service.controlplane.settings import ControlPlaneSettings
from protocol.torchrun import free_port

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(db: Path, **overrides) -> ControlPlaneSettings:
    return ControlPlaneSettings(token=TOKEN, db=db, groups=2, ranks_per_group=2, allowed_hosts=["testserver"],
                                lighthouse_api=f"http://127.0.0.1:{free_port()}", **overrides)


def registered_nowhere(db: Path, groups=(0, 1)) -> str:
    """Agents of ``groups`` that registered earlier at an address nothing answers now (in the
    control plane's file, as a restarted control plane finds them): commands to them fail."""
    nowhere, store = f"http://127.0.0.1:{free_port()}", Store(db)
    for g in groups:
        store.register_agent(g, nowhere, 2, time.time())
    store.close()
    return nowhere


@contextmanager
def real_agent(state_dir: Path, group: int) -> Iterator[str]:
    """Group ``group``'s own agent, without starting the group: it answers the registration
    challenge with its group's token. Yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    agent = AgentSettings(group=group, groups=group + 1, job_token=TOKEN, port=listener.getsockname()[1],
                          state_dir=state_dir / f"agent{group}", autostart=False, zygote=False, watchdog=False)
    server = uvicorn.Server(uvicorn.Config(agent_app(agent), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, f"group {group}'s agent")
        yield agent.api_url()
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "control.db"


@pytest.fixture
def api(db):
    registered_nowhere(db)
    with TestClient(create_app(settings(db)), base_url="http://127.0.0.1") as client:
        yield client


def scrape(api: TestClient) -> dict[tuple[str, tuple], float]:
    text = api.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


T0 = float(int(time.time()) - 3600)
"""An hour ago: events must be stamped within the control plane's clock skew and event age."""


def process(group: int, action: str, ts: float, **extra) -> dict:
    return {"type": "process", "ts": ts, "group": group, "action": action, **extra}


def trainer_event(kind: str, group: int, ts: float, rank: int = 0, **fields) -> dict:
    return {"type": kind, "ts": ts, "group": group, "rank": rank, **fields}


def step(group: int, ts: float, n: int, committed: bool = True, participating: bool = True, rank: int = 0,
         participants: int = 2) -> dict:
    return trainer_event("step", group, ts, rank, **step_fields(
        n, participants, committed=committed, loss=3.0, step_s=0.5, compute_s=0.4, participating=participating))


def start(group: int, ts: float) -> dict:
    return trainer_event("start", group, ts, **start_fields(replica_id=f"group{group}:x", ranks_per_group=2))


def heal(group: int, ts: float, at: int) -> dict:
    return trainer_event("heal", group, ts, step=at, source_group=0, bytes=1000, fetch_s=0.2, load_s=0.01)


def ingest(api: TestClient, group: int, events: list[dict], **extra) -> dict:
    response = api.post(f"/api/v1/ingest/{group}", json={"events": events, **extra}, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def training(api: TestClient) -> None:
    for g in (0, 1):
        ingest(api, g, [process(g, "started", T0), start(g, T0 + 1), step(g, T0 + 2, 1)])


def test_state_machine_from_a_recorded_kill_and_heal(api):
    ingest(api, 1, [
        process(1, "started", T0, pid=42), start(1, T0 + 5), heal(1, T0 + 6, 0),
        step(1, T0 + 6.5, 1, participating=False), step(1, T0 + 7, 1), step(1, T0 + 8, 2),
        process(1, "killed", T0 + 9),
        step(1, T0 + 8.9, 3),  # written before the kill, read after it: must not revive the group
        process(1, "started", T0 + 20, pid=43), start(1, T0 + 25), heal(1, T0 + 26, 30), step(1, T0 + 27, 31),
    ])
    group = api.get("/api/v1/groups/1").json()
    assert [(t["state"], t["reason"]) for t in group["transitions"]] == [
        ("starting", None), ("joining", None), ("healing", None), ("training", None), ("down", "killed"),
        ("starting", None), ("joining", None), ("healing", None), ("training", None),
    ]
    assert [t["ts"] for t in group["transitions"]] == [T0, T0 + 5, T0 + 6, T0 + 7, T0 + 9, T0 + 20, T0 + 25, T0 + 26, T0 + 27]
    assert group["state"] == "training" and group["step"] == 31 and group["pid"] == 43 and group["restarts"] == 1
    assert group["last_heal"]["step"] == 30 and group["last_heal"]["source_group"] == 0


def test_crash_and_finish_are_down_with_their_reason(api):
    ingest(api, 0, [process(0, "started", T0), start(0, T0 + 1), step(0, T0 + 2, 1), process(0, "crashed", T0 + 3, returncode=1)])
    ingest(api, 1, [process(1, "started", T0), step(1, T0 + 2, 1), process(1, "finished", T0 + 3, returncode=0)])
    states = {g["group"]: (g["state"], g["down_reason"]) for g in api.get("/api/v1/groups").json()}
    assert states == {0: ("down", "crashed"), 1: ("down", "finished")}


def test_every_mutation_needs_the_token_and_changes_nothing_without_it(api):
    training(api)
    before = api.get("/api/v1/events").json()["events"]
    for method, path, body in [
        ("post", "/api/v1/groups/1/kill", None), ("post", "/api/v1/groups/1/rejoin", None),
        ("post", "/api/v1/drills", {"kind": "kill-heal", "group": 1}),
        ("post", "/api/v1/ingest/0", {"events": [step(0, T0 + 9, 9)]}),
        ("delete", "/api/v1/drills/1", None),
    ]:
        missing = api.request(method, path, json=body)
        wrong = api.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        assert missing.status_code == 401 and "missing bearer token" in missing.json()["detail"]
        assert wrong.status_code == 403 and wrong.json()["detail"] == "wrong bearer token"
    assert api.get("/api/v1/events").json()["events"] == before
    assert api.get("/api/v1/drills").json()["drills"] == []
    assert {g["state"] for g in api.get("/api/v1/groups").json()} == {"training"}


def test_an_agents_token_posts_its_own_groups_events_and_nothing_else(api):
    """Each agent holds only its group's token: a stolen one cannot forge another group's events,
    command a group or start a drill."""
    agent0 = {"Authorization": f"Bearer {group_token(TOKEN, 0)}"}
    body = {"events": [process(0, "started", T0)]}
    assert api.post("/api/v1/ingest/0", json=body, headers=agent0).json()["accepted"] == 1
    assert api.post("/api/v1/ingest/1", json={"events": [process(1, "started", T0)]}, headers=agent0).status_code == 403
    assert api.post("/api/v1/ingest/1", json=body, headers=AUTH).json()["rejected"] == 1, "the path's group is the events'"
    assert api.post("/api/v1/groups/0/kill", headers=agent0).status_code == 403
    assert api.post("/api/v1/drills", json={"kind": "lighthouse"}, headers=agent0).status_code == 403
    assert [e["group"] for e in api.get("/api/v1/events").json()["events"]] == [0]


def test_a_foreign_host_name_is_refused_before_anything_else(api):
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 still sends its own Host."""
    for method, path in (("get", "/api/v1/groups"), ("post", "/api/v1/groups/0/kill")):
        response = api.request(method, path, headers={**AUTH, "Host": "evil.example:8000"})
        assert response.status_code == 421 and "Host 'evil.example'" in response.json()["detail"], response.text
    assert api.get("/api/v1/groups", headers={"Host": "127.0.0.1:8000"}).status_code == 200


def test_a_method_a_path_does_not_take_is_405_naming_every_one_it_does_with_or_without_the_token(api):
    """A path's reads and its commands are two routers: its ``Allow`` names both, and the answer
    comes before the token is asked for (a wrong method is not an authentication problem)."""
    for method, path, allow in [("TRACE", "/api/v1/groups", "GET"), ("PATCH", "/api/v1/groups/0", "GET"),
                                ("OPTIONS", "/api/v1/drills", "GET, POST"),
                                ("OPTIONS", "/api/v1/drills/3", "DELETE, GET"),
                                ("DELETE", "/api/v1/groups/0/kill", "POST"), ("POST", "/api/v1/drills/kinds", "GET")]:
        for headers in ({}, AUTH):
            response = api.request(method, path, headers=headers)
            assert (response.status_code, response.headers.get("allow")) == (405, allow), (method, path, response.text)
            assert response.json()["detail"] == f"{method} is not a method of {path}; it takes {allow}"
    assert api.request("DELETE", "/api/v1/drills/3").status_code == 401, "a method the path takes still needs the token"


def test_a_boolean_is_never_taken_for_a_number(api):
    """Pydantic's lax mode reads ``false`` as 0: a registration would have stored 0 ranks."""
    agents = api.get("/api/v1/agents").json()["agents"]
    for method, path, body in [("put", "/api/v1/agents/0", {"url": "http://127.0.0.1:9", "ranks_per_group": False}),
                               ("post", "/api/v1/ingest/0", {"events": [], "dropped": False}),
                               ("post", "/api/v1/drills", {"kind": "kill-heal", "group": True})]:
        response = api.request(method, path, json=body, headers=AUTH)
        assert response.status_code == 422 and "a number, not a boolean" in response.json()["detail"], response.text
    assert api.get("/api/v1/agents").json()["agents"] == agents and api.get("/api/v1/drills").json()["drills"] == []


def test_a_new_address_counts_only_once_the_agent_there_proves_it_holds_the_groups_token(api, tmp_path):
    """A mistyped or hostile registration cannot take a group's commands away: the address must
    answer the challenge with a proof made with the group's token and for that very address."""
    def register(group: int, url: str):
        return api.put(agent_path(group), json={"url": url},
                       headers={"Authorization": f"Bearer {group_token(TOKEN, group)}"})

    before = api.get("/api/v1/agents").json()["agents"]
    nobody = register(0, "http://127.0.0.1:9")
    assert nobody.status_code == 403 and "no agent answered group 0's registration challenge" in nobody.json()["detail"]
    with real_agent(tmp_path, 1) as url:
        impostor = register(0, url)  # a real agent, but group 1's: its proof is made with group 1's token
        assert impostor.status_code == 403, impostor.text
        assert impostor.json()["detail"] == f"the agent at {url} did not prove it holds group 0's token; its " \
                                            "registration is refused and the group keeps its agent"
        assert api.get("/api/v1/agents").json()["agents"] == before
        assert register(1, url).status_code == 200, "group 1's own agent proves it"
    assert register(1, url).status_code == 200, "renewing at the same address asks nothing (its agent is gone now)"
    assert [a["url"] for a in api.get("/api/v1/agents").json()["agents"]] == [before[0]["url"], url]


def test_a_body_over_the_limit_is_refused(db):
    with TestClient(create_app(settings(db, max_body_bytes=4096)), base_url="http://127.0.0.1") as api:
        big = {"events": [step(0, T0 + i, i) for i in range(40)]}
        response = api.post("/api/v1/ingest/0", json=big, headers=AUTH)
        assert response.status_code == 413 and "larger than 4096 bytes" in response.json()["detail"]
        chunked = api.post("/api/v1/ingest/0", content=iter([json.dumps(big).encode()]),
                           headers={**AUTH, "Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert api.get("/api/v1/events").json()["events"] == []


def test_weak_or_known_tokens_are_refused_by_every_service(db):
    for token in ("change-me", "change-me-local-only", "short-token"):
        with pytest.raises(ValueError, match="known placeholder|fewer than 16"):
            ControlPlaneSettings(token=token, db=db)
        with pytest.raises(ValueError, match="known placeholder|fewer than 16"):
            AgentSettings(group=0, groups=1, job_token=token)


def test_reads_without_the_token_never_show_what_torchfts_kill_paths_need(api):
    ingest(api, 0, [start(0, T0)])
    anonymous = api.get("/api/v1/events", params={"type": "start"}).json()["events"][0]
    assert anonymous["replica_id"] is None and anonymous["config"] == "llama3_debugmodel_bytes"
    assert api.get("/api/v1/events", params={"type": "start"}, headers=AUTH).json()["events"][0]["replica_id"] == "group0:x"


@pytest.mark.parametrize("path, params", [
    ("/api/v1/events", {"after_id": 2**63}), ("/api/v1/events", {"group": 2**64}), ("/api/v1/events", {"since": "nan"}),
    ("/api/v1/drills/18446744073709551616", {}), ("/api/v1/goodput", {"gpus": 0}),
    ("/api/v1/goodput", {"delta_s": 0}), ("/api/v1/goodput", {"gpu_mtbf_hours": "inf"}),
])
def test_out_of_range_queries_are_a_clear_422_not_a_500(api, path, params):
    response = api.get(path, params=params)
    assert response.status_code == 422 and response.json()["detail"], response.text


def test_a_drill_body_with_nan_or_infinity_is_a_clear_422(api):
    training(api)
    for body in ('{"kind": "chaos", "mtbf_s": NaN, "duration_s": 10}', '{"kind": "chaos", "mtbf_s": 5, "duration_s": Infinity}',
                 '{"kind": "straggler", "group": 0, "delay_ms": 1e400}', '{"kind": "chaos", "mtbf_s": 1e9, "duration_s": 10}'):
        response = api.post("/api/v1/drills", content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code == 422 and "body." in response.json()["detail"], (body, response.text)
    assert api.get("/api/v1/drills").json()["drills"] == []


def test_unknown_group_is_404(api):
    assert api.get("/api/v1/groups/7").status_code == 404
    assert "this job has groups 0..1" in api.get("/api/v1/groups/7").json()["detail"]
    assert api.post("/api/v1/groups/7/kill", headers=AUTH).status_code == 404
    assert api.post("/api/v1/groups/7/rejoin", headers=AUTH).status_code == 404
    assert api.post("/api/v1/drills", json={"kind": "kill-heal", "group": 7}, headers=AUTH).status_code == 404
    assert api.get("/api/v1/drills/99").status_code == 404


def test_a_group_joins_the_job_by_registering_or_posting_events_up_to_max_groups(api, tmp_path):
    """Nothing lists the groups in advance: a new group number joins with its agent's first word."""
    assert api.post("/api/v1/ingest/7", json={"events": []}, headers=AUTH).json()["agent_registered"] is False
    assert api.get("/api/v1/groups/7").json()["state"] == "unknown"
    with real_agent(tmp_path, 9) as url:
        registered = api.put(agent_path(9), json={"url": url, "ranks_per_group": 1},
                             headers={"Authorization": f"Bearer {group_token(TOKEN, 9)}"})
        assert registered.status_code == 200, registered.text
    assert [g["group"] for g in api.get("/api/v1/groups").json()] == [0, 1, 7, 9]
    assert {a["group"] for a in api.get("/api/v1/agents").json()["agents"]} == {0, 1, 9}
    assert api.post("/api/v1/ingest/9", json={"events": []}, headers=AUTH).json()["agent_registered"] is True
    assert 'ftctl_commits_total{group="9"} 0.0' in api.get("/metrics").text
    beyond = api.post("/api/v1/ingest/4096", json={"events": []}, headers=AUTH)
    assert beyond.status_code == 409 and "--max-groups 4096" in beyond.json()["detail"]
    assert api.get("/api/v1/groups/4096").status_code == 404


def test_state_conflicts_are_409_and_change_nothing(api):
    ingest(api, 0, [process(0, "started", T0), step(0, T0 + 1, 1)])
    ingest(api, 1, [process(1, "started", T0), step(1, T0 + 1, 1), process(1, "killed", T0 + 2)])
    kill = api.post("/api/v1/groups/1/kill", headers=AUTH)
    assert kill.status_code == 409 and "already down" in kill.json()["detail"]
    rejoin = api.post("/api/v1/groups/0/rejoin", headers=AUTH)
    assert rejoin.status_code == 409 and "only a down group can rejoin" in rejoin.json()["detail"]
    drill = api.post("/api/v1/drills", json={"kind": "kill-heal", "group": 1}, headers=AUTH)
    assert drill.status_code == 409 and "rejoin it before drilling" in drill.json()["detail"]
    lonely = api.post("/api/v1/drills", json={"kind": "kill-heal", "group": 0}, headers=AUTH)
    assert lonely.status_code == 409 and "no other group is training" in lonely.json()["detail"]
    chaos = api.post("/api/v1/drills", json={"kind": "chaos", "mtbf_s": 5, "duration_s": 10}, headers=AUTH)
    assert chaos.status_code == 409 and "chaos needs at least 2 groups training, 1 are" in chaos.json()["detail"]
    assert api.get("/api/v1/drills").json()["drills"] == []
    assert [g["state"] for g in api.get("/api/v1/groups").json()] == ["training", "down"]


def test_a_partition_drill_between_groups_on_one_host_is_409_before_anything_is_cut(api):
    """Every agent here listens on loopback, as under `ftctl up`: a route cannot part them."""
    training(api)
    for body in ({"kind": "partition", "cut": [0, 1]}, {"kind": "partition", "isolate": 1}):
        response = api.post("/api/v1/drills", json=body, headers=AUTH)
        assert response.status_code == 409 and "listens on loopback" in response.json()["detail"], response.json()
    unknown = api.post("/api/v1/drills", json={"kind": "partition", "cut": [0, 7]}, headers=AUTH)
    assert unknown.status_code == 404
    assert api.get("/api/v1/drills").json()["drills"] == []


def test_a_second_drill_while_one_runs_is_409(api):
    training(api)
    first = api.post("/api/v1/drills", json={"kind": "kill-heal", "group": 1}, headers=AUTH)
    assert first.status_code == 202 and first.headers["location"] == f"/api/v1/drills/{first.json()['id']}"
    second = api.post("/api/v1/drills", json={"kind": "kill-heal", "group": 0}, headers=AUTH)
    if api.get(f"/api/v1/drills/{first.json()['id']}").json()["status"] == "running":
        assert second.status_code == 409 and "still running" in second.json()["detail"]
    # the agents do not exist here: the drill fails at its kill, saying why
    for _ in range(100):
        drill = api.get(f"/api/v1/drills/{first.json()['id']}").json()
        if drill["status"] != "running":
            break
        time.sleep(0.05)
    assert drill["status"] == "failed" and drill["error"].startswith("kill: the agent of group 1")
    assert api.get("/api/v1/groups/1").json()["state"] == "training", "a failed kill must not mark the group down"


def test_malformed_input_is_422_with_one_clear_line(api):
    cases = [
        ({"kind": "chaos-monkey", "group": 1}, "body: Input tag 'chaos-monkey' found using 'kind' does not match"),
        ({"kind": "kill-heal"}, "body.kill-heal.group: Field required"),
        ({"kind": "kill-heal", "group": -1}, "body.kill-heal.group: Input should be greater than or equal to 0"),
        ({"kind": "kill-heal", "group": 1, "surprise": True}, "body.kill-heal.surprise: Extra inputs are not permitted"),
        ({"kind": "chaos", "duration_s": 10}, "body.chaos.mtbf_s: Field required"),
        ({"kind": "chaos", "mtbf_s": 0, "duration_s": 10}, "body.chaos.mtbf_s: Input should be greater than 0"),
        ({"kind": "partition"}, "body.partition: Value error, name either cut (two groups) or isolate (one group)"),
        ({"kind": "partition", "cut": [1, 1]}, "body.partition: Value error, cut needs two different groups"),
        ({"kind": "partition", "cut": [0, 1, 2]}, "body.partition.cut: List should have at most 2 items"),
    ]
    for body, detail in cases:
        response = api.post("/api/v1/drills", json=body, headers=AUTH)
        assert response.status_code == 422 and response.json()["detail"].startswith(detail), response.json()
    bad_type = api.get("/api/v1/events", params={"type": "nonsense"})
    assert bad_type.status_code == 422 and "query.type.0: Input should be 'start'" in bad_type.json()["detail"]
    assert api.post("/api/v1/drills", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"}).status_code == 422
    assert api.get("/api/v1/drills").json()["drills"] == []


def test_invalid_events_are_rejected_and_counted_not_stored(api):
    result = ingest(api, 0, [{"type": "step", "ts": T0, "group": 0}, {"type": "teleport", "ts": T0, "group": 0},
                             step(1, T0, 1), step(0, T0, 1)], dropped=3)
    assert (result["accepted"], result["rejected"], result["duplicates"]) == (1, 3, 0)
    assert result["reasons"][2] == "group: an event of group 1 in a batch of group 0"
    assert [e["type"] for e in api.get("/api/v1/events").json()["events"]] == ["step"]


def test_a_bad_event_is_rejected_alone_and_never_wedges_ingestion_or_loses_later_writes(db):
    """An integer SQLite cannot hold, a NaN time (Python's JSON reads it), a negative byte count, a
    clock far ahead: each is refused with a line of why, in the same batch as good events that are
    stored; later batches, transitions and drills are stored too, and all of it survives a restart."""
    bad = [step(0, T0 + 1, 10**20), {**step(0, T0 + 1, 2), "ts": math.nan}, {**heal(0, T0 + 1, 1), "bytes": -1},
           step(0, time.time() + 3600, 3), {**step(0, T0 + 1, 4), "loss": math.inf}]
    with TestClient(create_app(settings(db))) as api:
        body = json.dumps({"events": [process(0, "started", T0), *bad, start(0, T0 + 2)]})
        response = api.post("/api/v1/ingest/0", content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        result = response.json()
        assert (result["accepted"], result["rejected"]) == (2, 5), result
        assert [r.split(":")[0] for r in result["reasons"]] == ["step.step", "step.ts", "heal.bytes", "ts", "step.loss"]
        later = ingest(api, 0, [step(0, T0 + 3, 1)])
        assert (later["accepted"], later["rejected"]) == (1, 0)
        assert api.get("/api/v1/groups/0").json()["state"] == "training"
        assert scrape(api)[("ftctl_events_rejected_total", (("group", "0"),))] == 5
    with TestClient(create_app(settings(db))) as api:
        view = api.get("/api/v1/groups/0").json()
        assert [t["state"] for t in view["transitions"]] == ["starting", "joining", "training"]
        assert [e["type"] for e in api.get("/api/v1/events").json()["events"]] == ["process", "start", "step"]
        assert scrape(api)[("ftctl_events_rejected_total", (("group", "0"),))] == 5, "counts survive a restart"


def test_an_event_sent_again_is_stored_once(api):
    """A retry after the store committed but the reply was lost: the same eids, stored once, counted."""
    batch = [{**step(0, T0 + i, i), "eid": f"g0.r0-abc:{i}"} for i in (1, 2, 3)]
    assert ingest(api, 0, batch)["accepted"] == 3
    again = ingest(api, 0, [*batch, {**step(0, T0 + 4, 4), "eid": "g0.r0-abc:4"}])
    assert (again["accepted"], again["duplicates"]) == (1, 3)
    assert [e["step"] for e in api.get("/api/v1/events").json()["events"]] == [1, 2, 3, 4]
    assert scrape(api)[("ftctl_events_duplicate_total", (("group", "0"),))] == 3


def test_a_loss_that_is_not_finite_shows_as_divergence_not_as_a_missing_step(api):
    training(api)
    ingest(api, 0, [{**step(0, T0 + 3, 2), "loss": None}])
    view = api.get("/api/v1/groups/0").json()
    assert (view["step"], view["loss"], view["diverged"]) == (2, None, True)
    assert math.isnan(scrape(api)[("ftctl_group_loss", (("group", "0"),))])
    assert api.get("/api/v1/groups/1").json()["diverged"] is False


def test_events_filter_by_group_type_and_time_and_paginate(api):
    events = [step(g, T0 + i, i) for i in range(12) for g in (0, 1)]
    ingest(api, 0, [e for e in events if e["group"] == 0] + [heal(0, T0 + 20, 5)])
    ingest(api, 1, [e for e in events if e["group"] == 1])
    page = api.get("/api/v1/events", params={"group": 0, "type": "step", "limit": 5}).json()
    seen = [e["step"] for e in page["events"]]
    while page["next_after_id"] is not None:
        page = api.get("/api/v1/events", params={"group": 0, "type": "step", "limit": 5,
                                                 "after_id": page["next_after_id"]}).json()
        seen += [e["step"] for e in page["events"]]
    assert seen == list(range(12))
    assert [e["type"] for e in api.get("/api/v1/events", params={"group": 0, "type": "heal"}).json()["events"]] == ["heal"]
    recent = api.get("/api/v1/events", params={"since": T0 + 10, "type": ["step", "heal"]}).json()["events"]
    assert sorted((e["group"], e.get("step")) for e in recent) == [(0, 5), (0, 10), (0, 11), (1, 10), (1, 11)]


def test_history_and_drills_survive_a_restart(db):
    with TestClient(create_app(settings(db))) as api:
        training(api)
        ingest(api, 1, [process(1, "killed", T0 + 5)])
        store = Store(db)
        running = store.create_drill("kill-heal", 1, {"group": 1, "phase": "heal"})
        store.close()
    with TestClient(create_app(settings(db))) as api:
        group = api.get("/api/v1/groups/1").json()
        assert group["state"] == "down" and group["down_reason"] == "killed" and group["step"] == 1
        assert [t["state"] for t in group["transitions"]] == ["starting", "joining", "training", "down"]
        assert len(api.get("/api/v1/events").json()["events"]) == 7
        drill = api.get(f"/api/v1/drills/{running}").json()
        assert drill["status"] == "failed" and "control plane restarted" in drill["error"]
        ingest(api, 1, [process(1, "started", T0 + 9)])
        assert api.get("/api/v1/groups/1").json()["state"] == "starting"


def test_schema_is_versioned_and_a_newer_file_is_refused(db):
    Store(db).close()
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SchemaTooNew, match="newer than this control plane"):
        Store(db)


def test_a_file_of_the_first_schema_is_migrated_with_its_events(db):
    conn = sqlite3.connect(db)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; PRAGMA user_version = 1; COMMIT;")
    old = json.dumps(process(0, "started", T0))
    conn.execute("INSERT INTO events (ts, received, grp, rank, type, step, body) VALUES (?, ?, 0, NULL, 'process', "
                 "NULL, ?)", (T0, T0, old))
    conn.execute("INSERT INTO transitions (grp, state, reason, ts) VALUES (0, 'starting', NULL, ?)", (T0,))
    conn.commit()
    conn.close()
    with TestClient(create_app(settings(db))) as api:
        assert api.get("/api/v1/groups/0").json()["state"] == "starting"
        assert ingest(api, 0, [{**step(0, T0 + 1, 1), "eid": "x:1"}, {**step(0, T0 + 1, 1), "eid": "x:1"}])["duplicates"] == 1
        assert [e["type"] for e in api.get("/api/v1/events").json()["events"]] == ["process", "step"]


def test_quorum_health_and_docs_without_a_lighthouse(api):
    quorum = api.get("/api/v1/quorum").json()
    assert quorum["lighthouse_reachable"] is False and quorum["lighthouse_error"]
    assert [g["group"] for g in quorum["groups"]] == [0, 1]
    assert api.get("/healthz").json() == {"ok": True, "checks": {}, "server_pid": os.getpid()}
    ready = api.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["sqlite"] == "ok"
    assert api.get("/openapi.json").status_code == 200 and api.get("/docs").status_code == 200


def test_goodput_projects_the_measured_recovery_to_scale(db):
    with TestClient(create_app(settings(db))) as api:
        missing = api.get("/api/v1/goodput")
        assert missing.status_code == 409 and "no kill-heal drill has finished" in missing.json()["detail"]
        training(api)
    store = Store(db)
    drill = store.create_drill("kill-heal", 1, {})
    store.update_drill(drill, "done", {"group": 1, "detect_s": 1.0, "survivors_resume_s": 1.3,
                                       "rejoin_to_healed_commit_s": 1.5, "survivors_steps_lost": 1,
                                       "fingerprints_equal": True})
    store.close()
    with TestClient(create_app(settings(db))) as api:
        out = api.get("/api/v1/goodput", params={"gpus": [1024, 16384]}).json()
    assert out["measured"]["drills"] == 1 and out["measured"]["reconfigure_s"] == pytest.approx(0.3)
    ours = {p["gpus"]: p for p in out["projections"] if p["path"].startswith("this service")}
    classic = {p["gpus"]: p for p in out["projections"] if p["path"] == "classic restart"}
    assert ours[16384]["goodput"] > classic[16384]["goodput"] > 0.9
    assert classic[16384]["goodput"] == pytest.approx(0.9449, abs=1e-4)  # the seed's scenario C
    assert ours[16384]["inputs"]["rollback_s"] == pytest.approx(0.5)  # one step at 0.5 s
    assert out["answer"][1].startswith("at 16384 GPUs with our measured recovery (a rejoin of 1.5 s), goodput would be")
    assert "assumed: the seed's scenario C" in out["classic_source"]


def test_goodput_scales_the_heal_to_the_state_and_link_asked_about(db):
    """"8B on 8 GPUs per group at 25 GB/s": the rejoin as measured, its transfer (2 s for 1 GB
    here) replaced by 12 GB at 25 GB/s."""
    store = Store(db)
    drill = store.create_drill("kill-heal", 1, {})
    store.update_drill(drill, "done", {"group": 1, "detect_s": 1.0, "survivors_resume_s": 1.3,
                                       "rejoin_to_healed_commit_s": 5.0, "survivors_steps_lost": 1,
                                       "heal_bytes": 10**9, "heal_fetch_s": 2.1,
                                       "recovery": [{"phase": "transfer", "label": "transfer", "seconds": 2.0}]})
    store.close()
    with TestClient(create_app(settings(db))) as api:
        training(api)
        asked = {"gpus": [16384], "gpus_per_group": 8}
        measured = api.get("/api/v1/goodput", params=asked).json()
        scaled = api.get("/api/v1/goodput", params={**asked, "state_gb_per_rank": 12, "heal_gb_per_s": 25}).json()
        slow_link = api.get("/api/v1/goodput", params={**asked, "state_gb_per_rank": 12}).json()
    assert (measured["measured"]["heal_transfer_s"], measured["measured"]["heal_bytes"]) == (2.0, 1e9)
    ours = lambda out: next(p for p in out["projections"] if p["path"].startswith("this service"))  # noqa: E731
    assert ours(measured)["inputs"]["load_s"] == pytest.approx(5.0 / 2048)
    assert ours(scaled)["inputs"]["load_s"] == pytest.approx((5.0 - 2.0 + 12 / 25) / 2048)
    assert "a rejoin of 3.5 s" in scaled["answer"][0]
    assert ours(slow_link)["inputs"]["load_s"] == pytest.approx((3.0 + 12 / 0.5) / 2048), "at the measured 0.5 GB/s"


def test_goodput_weighs_a_hangs_detection_by_how_often_hangs_happen(db):
    store = Store(db)
    for kind, detect in (("kill-heal", 1.0), ("hang", 3.0)):
        drill = store.create_drill(kind, 1, {})
        store.update_drill(drill, "done", {"group": 1, "detect_s": detect, "survivors_resume_s": detect + 0.3,
                                           "rejoin_to_healed_commit_s": 1.5, "survivors_steps_lost": 1})
    store.close()
    with TestClient(create_app(settings(db))) as api:
        training(api)
        out = api.get("/api/v1/goodput", params={"gpus": [16384], "hang_fraction": 0.25}).json()
    assert (out["measured"]["hang_drills"], out["measured"]["hang_detect_s"]) == (1, 3.0)
    ours = next(p for p in out["projections"] if p["path"].startswith("this service"))
    assert ours["inputs"]["detect_s"] == pytest.approx(0.75 * 1.0 + 0.25 * 3.0)


def test_goodput_takes_delta_from_the_measured_checkpoint_stall_unless_told(db):
    """δ of this service is how long a step waited for a save (written off the step: the copy);
    the classic path saves synchronously, so its δ is the whole save."""
    store = Store(db)
    drill = store.create_drill("kill-heal", 1, {})
    store.update_drill(drill, "done", {"group": 1, "detect_s": 1.0, "survivors_resume_s": 1.3,
                                       "rejoin_to_healed_commit_s": 1.5, "survivors_steps_lost": 1})
    store.close()
    saves = [trainer_event("checkpoint", 0, T0 + 3 + i, action="saved", step=10 * i, seconds=seconds, stall_s=stall,
                           path=f"/ckpt/step-{10 * i:08d}") for i, (seconds, stall) in enumerate(
                               [(0.4, 0.02), (0.5, 0.03), (0.6, 0.04)], 1)]
    with TestClient(create_app(settings(db))) as api:
        training(api)
        ingest(api, 0, saves)

        def inputs(**params) -> dict[str, dict]:
            out = api.get("/api/v1/goodput", params={"gpus": [16384], **params}).json()
            return {p["path"]: p["inputs"] for p in out["projections"]} | {"measured": out["measured"]}

        measured = inputs()
        assert measured["this service (measured)"]["delta_s"] == pytest.approx(0.03)
        assert measured["classic restart"]["delta_s"] == pytest.approx(0.5)
        assert (measured["measured"]["checkpoint_stall_s"], measured["measured"]["checkpoint_save_s"]) == (0.03, 0.5)
        told = inputs(delta_s=5)
        assert told["this service (measured)"]["delta_s"] == told["classic restart"]["delta_s"] == 5
        metrics = api.get("/metrics").text
        assert 'ftctl_checkpoint_stall_seconds_bucket{le="0.025"} 1.0' in metrics


def test_events_past_retention_are_deleted_and_the_newest_kept(db):
    store = Store(db)
    now = time.time()
    old = [trainer_event("quorum", 0, now - 100, quorum_id=1, previous_quorum_id=0, step=i, participants=1)
           for i in range(3)]
    fresh = [trainer_event("quorum", 0, now - i, quorum_id=1, previous_quorum_id=0, step=10 + i, participants=1)
             for i in range(5)]
    store.add_events([parse_event(json.dumps(e)) for e in old + fresh])
    assert store.prune_events(older_than=now - 50, keep_rows=3) == 3 + 2
    assert [e["step"] for e in store.events(limit=100)] == [12, 13, 14]
    store.close()


def test_a_post_past_the_writers_queue_is_refused_at_once_and_the_queued_ones_are_stored(db):
    """A store that is behind answers 503 to new posts (the agents keep their events and back off)
    rather than queueing every retry; what was queued is stored, each batch answered."""
    services = build_services(settings(db))
    writer = IngestWriter(services.ingest, linger_s=0.0, max_queued_events=4)

    async def run():
        batch = lambda g, n: IngestBatch(events=[trainer_event("quorum", g, time.time(), quorum_id=1,  # noqa: E731
                                                               previous_quorum_id=0, step=i, participants=1)
                                                 for i in range(n)])
        first, second = (asyncio.ensure_future(writer.submit(g, batch(g, 2), "post")) for g in (0, 1))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await writer.submit(0, batch(0, 1), "post")
        task = asyncio.ensure_future(writer.run())
        answers = await asyncio.gather(first, second)
        task.cancel()
        return answers

    answers = asyncio.run(run())
    assert [a.accepted for a in answers] == [2, 2]
    assert len(services.store.events(limit=100)) == 4
    services.store.close()


def test_an_agent_streams_its_batches_and_each_gets_the_answer_a_post_would(api):
    """One message per batch on the group's WebSocket, one answer each, in order; a bad message
    costs only its own answer, and the stream goes on."""
    from starlette.websockets import WebSocketDisconnect

    from protocol.ingest import StreamAnswer, ingest_stream_path

    def answer(ws, text: str) -> StreamAnswer:
        ws.send_text(text)
        return StreamAnswer.model_validate_json(ws.receive_text())

    own = {"Authorization": f"Bearer {group_token(TOKEN, 0)}"}
    with api.websocket_connect(ingest_stream_path(0), headers=own) as ws:
        first = answer(ws, json.dumps({"events": [start(0, T0), step(0, T0 + 1, 1)]}))
        assert first.status == 200 and first.result.accepted == 2 and first.result.agent_registered
        bad = answer(ws, "{not a batch")
        assert bad.status == 422 and bad.detail.startswith("no ingest batch"), bad
        ws.send_bytes(b"\xff\xfe")
        assert StreamAnswer.model_validate_json(ws.receive_text()).status == 422, "a binary frame of no JSON"
        mixed = answer(ws, json.dumps({"events": [step(0, T0 + 2, 2), step(1, T0 + 2, 2)]}))
        assert (mixed.result.accepted, mixed.result.rejected) == (1, 1) and "group" in mixed.result.reasons[0]
    assert [e["step"] for e in api.get("/api/v1/events", params={"type": "step"}).json()["events"]] == [1, 2]
    assert 'ftctl_ingest_batches_total{transport="stream"} 2.0' in api.get("/metrics").text
    for path, headers in ((ingest_stream_path(1), own), (ingest_stream_path(0), {}),
                          (ingest_stream_path(5000), {"Authorization": f"Bearer {group_token(TOKEN, 5000)}"})):
        with pytest.raises(WebSocketDisconnect):  # another group's token, none, beyond --max-groups
            with api.websocket_connect(path, headers=headers) as ws:
                ws.receive_text()
