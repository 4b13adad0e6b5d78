"""The service inside a real Slurm allocation (``deploy/slurm/ftctl.sbatch``): a private munged,
slurmctld and two slurmd (two nodes on this host, ``slurmd -N``) started here and stopped by pid;
the job submitted with ``sbatch``; a group's step cancelled (a crash), one drained with
``scancel --signal=TERM``; the job cancelled, nothing of ours left."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import REPO, wait_for
from processes import Owner
from protocol.torchrun import free_port
from service.client import ApiError, ControlPlane

TOKEN = "slurm-token-0123456789abcdef"
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(map(os.path.exists, DAEMONS)) or not shutil.which("sbatch"),
    reason="needs root and Debian's munge, slurmctld, slurmd and slurm-client (make system-deps installs them)")


def slurm_conf(d: Path, munge_socket: Path) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName=n{i} NodeHostname={host} Port={free_port()} CPUs=1 RealMemory=4000 State=UNKNOWN"
                      for i in (1, 2))
    return f"""ClusterName=ftctltest
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmUser=root
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running Slurm of two nodes; yields (environment for its commands, owner)."""
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    os.chmod(d / "munge", 0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = d / "munge" / "munge.socket"
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, munge_socket))
    started: list[subprocess.Popen] = []
    with Owner() as owner:
        env = owner.env(SLURM_CONF=str(conf))
        try:
            started.append(subprocess.Popen(
                ["/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
                 f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                 f"--seed-file={d}/munge/munged.seed"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            wait_for(munge_socket.exists, 10, "munged's socket")
            started.append(subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            for node in ("n1", "n2"):
                started.append(subprocess.Popen(["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(conf)], env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

            def idle() -> bool:
                out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True)
                return out.stdout.split() == ["idle", "2"]

            wait_for(idle, 60, "both Slurm nodes idle")
            yield env, owner
        finally:
            for proc in reversed(started):
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run(env: dict, *argv: str) -> str:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def step_of(env: dict, job: str, name: str) -> str:
    rows = [line.split() for line in run(env, "squeue", "-s", "-h", "-j", job, "-o", "%i %j").splitlines()]
    return next(step for step, step_name in rows if step_name == name)


def test_the_service_in_a_slurm_job_survives_a_cancelled_step_and_a_drained_one(slurm, tmp_path):
    env, _ = slurm
    ports = {name: free_port() for name in ("CP_PORT", "LH_PORT", "LH_API_PORT")}
    owner = Owner()  # the job's processes (sbatch passes the environment on to every step), not Slurm's
    job_env = owner.env(SLURM_CONF=env["SLURM_CONF"], **{k: str(v) for k, v in ports.items()}, FTCTL_TOKEN=TOKEN,
                        FTCTL_STATE=str(tmp_path / "job"), FTCTL_PYTHON=sys.executable,
                        TRAINER_ARGS='["--steps", "100000", "--seq-len", "64", "--local-batch-size", "2", '
                                     '"--fingerprint-every", "1"]')
    job = run(job_env, "sbatch", "--parsable", "-N2", "-D", str(REPO), "-o", str(tmp_path / "job-%j.out"),
              str(REPO / "deploy/slurm/ftctl.sbatch")).strip()
    try:
        with ControlPlane.at(f"http://127.0.0.1:{ports['CP_PORT']}", TOKEN, timeout=10) as control:
            def states() -> dict[int, tuple[str, str | None]]:
                try:
                    return {g["group"]: (g["state"], g.get("down_reason")) for g in control.groups()}
                except (ApiError, ValueError):
                    return {}

            wait_for(lambda: states() == {0: ("training", None), 1: ("training", None)}, 300, "both groups training")
            cancelled_at = time.time()
            run(env, "scancel", step_of(env, job, "group1"))  # a crash: the step's processes SIGKILLed
            wait_for(lambda: states().get(1) == ("down", "lost"), 30, "group 1 lost")
            wait_for(lambda: states().get(1) == ("training", None)
                     and (control.group(1).get("last_heal") or {}).get("ts", 0) > cancelled_at, 240,
                     "group 1's step started again by the batch script, healed and training")
            fingerprints = [e for e in control.events(type="fingerprint", since=cancelled_at) if e["rank"] == 0]
            by_step = {}
            for e in fingerprints:
                by_step.setdefault(e["step"], {})[e["group"]] = e["digest"]
            both = [digests for digests in by_step.values() if len(digests) == 2]
            assert both and all(d[0] == d[1] for d in both), "the healed group holds the others' state bitwise"

            drained_at = time.time()
            # Slurm 22.05's scancel signals the step, then fails to signal "job step id <job>" and exits 225
            subprocess.run(["scancel", "--signal=TERM", step_of(env, job, "group1")], env=env, timeout=60)
            wait_for(lambda: states().get(1) == ("down", "drained"), 60, "group 1 drained")
            time.sleep(5)
            assert not control.events(type="commit_failed", since=drained_at), "a survivor's commit failed"
            assert states().get(0) == ("training", None)
            assert states().get(1) == ("down", "drained"), "a drained group is not started again"
    finally:
        subprocess.run(["scancel", job], env=env, timeout=60)
    def ended() -> bool:
        listed = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, timeout=60)
        return listed.returncode != 0 or not listed.stdout.strip()

    wait_for(ended, 60, "the job to end")
    time.sleep(2)
    assert owner.end() == [], "processes of the job outlived it"
