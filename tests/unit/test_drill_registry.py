"""A drill kind is one module of ``service/controlplane/drills``: the registry is what every
consumer reads, so each kind shows up everywhere without being named anywhere else."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from protocol import api
from protocol.settings import parse_settings
from service.cli import Ftctl
from service.controlplane.app import create_app
from service.controlplane.drills import DRILLS, FAULT_CLASSES
from service.drill_command import flag_of
from test_controlplane_api import AUTH, settings


def test_every_kind_is_served_exported_and_a_command(tmp_path):
    with TestClient(create_app(settings(tmp_path / "control.db")), base_url="http://127.0.0.1") as client:
        kinds = client.get(api.url(api.DRILL_KINDS)).json()
        schema = client.get("/openapi.json").json()
        metrics = client.get("/metrics").text
        refused = client.post(api.url(api.DRILLS), json={"kind": "no-such-drill"}, headers=AUTH).json()["detail"]
    assert [k["kind"] for k in kinds] == list(DRILLS)
    assert {k["fault_class"]: k["kind"] for k in kinds if k["fault_class"]} == {
        fault: drill.kind for fault, drill in FAULT_CLASSES.items()}
    body = schema["paths"][api.url(api.DRILLS)]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["discriminator"]["mapping"]) == set(DRILLS)
    assert all(f"'{kind}'" in refused for kind in DRILLS), refused
    exported = {s.labels["kind"] for f in text_string_to_metric_families(metrics) if f.name == "ftctl_drills"
                for s in f.samples}
    assert exported == set(DRILLS), "each kind's drill counts are there at zero before any drill ran"


def test_ftctl_drill_takes_every_kind_and_every_field_of_its_request():
    for kind, drill in DRILLS.items():
        flags = []
        for name, field in drill.Request.model_fields.items():
            if name == "kind" or field.annotation is bool or (not field.is_required() and field.default is None):
                continue
            value = field.default if not field.is_required() else 1
            flags += [f"--{flag_of(name).replace('_', '-')}", str(value)]
        if kind == "partition":  # one of cut or isolate
            flags += ["--cut", "1,2"]
        body = parse_settings(Ftctl, "ftctl", ["drill", kind, *flags]).drill.body()
        assert body["kind"] == kind and drill.Request.model_validate(body)
