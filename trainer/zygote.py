"""``python -m trainer.zygote SOCKET -- TRAINER_ARGS``: a process that has paid for a start once, and
forks replica groups from it.

A cold start of a group pays, in every rank, for the interpreter, ``import torch``, torchft,
torchtitan's model code (3.3 s here) and opening its dataset, before it builds its model.
The agent keeps one zygote per group: it pays all of that once, when the agent starts, and then
answers each start of the group or of its warm spare with a fork (:mod:`protocol.zygote`). The
forked ranks share the zygote's memory copy-on-write.

The fork of the zygote is the group's *leader*, which does what ``torchrun --nnodes=1
--nproc-per-node=K --max-restarts=0`` does for the group:

- it forks K ranks, each with the environment torchrun gives a rank (:func:`protocol.torchrun.rank_env`),
  and runs the trainer in them as ``python -m trainer`` would under torchrun;
- a rank that fails ends the others (SIGTERM, SIGKILL after :data:`RANK_GRACE_S`) and the leader
  exits with that rank's code (128 + N for signal N); when all exit 0, so does the leader;
- SIGTERM, SIGINT or SIGHUP to the leader reaches every rank: they finish their step and leave.

Lifetimes nest: a rank dies with its leader, a leader with its zygote (``PR_SET_PDEATHSIG``), and a
zygote leaves when its agent has gone. The agent ends a forked group as it ends a torchrun tree.

Forking is safe only from a process with one thread: the zygote checks that it has one after its
imports and refuses to serve otherwise (the agent then starts groups with torchrun).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from protocol.lifetime import die_with_parent
from protocol.settings import fail, parse_settings
from protocol.torchrun import rank_env
from protocol.zygote import READY_LINE, SpawnReply, SpawnRequest
from trainer.config import TrainerConfig
from trainer.errors import ConfigError

RANK_GRACE_S = 5.0
"""After a rank failed, how long the others get to leave before SIGKILL. They are usually stuck in
a collective with the dead rank by then; torchrun gives them 30 s, which only delays the restart."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 1 << 20
PARENT_POLL_S = 1.0


def preload(trainer_args: list[str]) -> float:
    """Import everything a rank runs, open the group's tokenized dataset (tokenizing it if no cache
    holds it yet) and order its first epoch; returns the seconds it took."""
    start = time.time()
    cfg = parse_settings(TrainerConfig, "trainer.zygote", trainer_args)
    import trainer.train  # noqa: F401  torch, torchft, the training loop and what it imports
    from trainer.builder import data_plan, open_dataset
    from trainer.job import job_config

    job = job_config(cfg)  # torchtitan's model code, the config's own modules
    data_plan(cfg, job, open_dataset(cfg, job), cfg.ranks_per_group).window(0)  # the epoch's order, kept
    warm_up()
    return time.time() - start


def warm_up() -> None:
    """Build, initialise and give optimizer state to the small byte-level debug model once,
    unsharded, whatever the job's model: a process's first build pays one-time costs (lazy
    initialisation in torch and torchtitan, about 0.15 s of CPU here) that every fork then
    inherits paid."""
    import torch

    from trainer.configs import llama3_debugmodel_bytes
    from trainer.cpu_compat import use_sdpa_attention
    from trainer.job import quiet_root_logger
    from trainer.state import materialize_optimizer_state

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with quiet_root_logger():
        job = llama3_debugmodel_bytes()
    with torch.device("meta"):
        model = use_sdpa_attention(job.model_spec.model).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    materialize_optimizer_state([torch.optim.AdamW(model.parameters())])


def threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def serve(path: Path) -> None:
    """Accept spawn requests until the agent is gone or SIGTERM; each answered with a fork."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    listener.bind(str(staging))
    os.chmod(staging, 0o600)
    listener.listen(16)
    os.replace(staging, path)  # the socket appears ready to accept, never half set up
    agent = os.getppid()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    try:
        while os.getppid() == agent:
            for key, _ in selector.select(PARENT_POLL_S):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    _answer(conn, selector)
                else:
                    _report_exit(key, selector)
    finally:
        path.unlink(missing_ok=True)


def _answer(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        request = SpawnRequest.model_validate_json(conn.makefile("rb").readline(MAX_REQUEST_BYTES))
    except (OSError, ValidationError) as err:
        _send(conn, SpawnReply(error=f"bad spawn request: {err}"))
        conn.close()
        return
    zygote = os.getpid()
    leader = os.fork()
    if leader == 0:
        try:
            lead(request, zygote)
        finally:
            os._exit(70)  # EX_SOFTWARE: lead() never returns
    if not _send(conn, SpawnReply(pid=leader)):
        os.kill(leader, signal.SIGKILL)  # nobody would watch this group: it must not train
    selector.register(os.pidfd_open(leader), selectors.EVENT_READ, (conn, leader))


def _report_exit(key: selectors.SelectorKey, selector: selectors.BaseSelector) -> None:
    conn, leader = key.data
    selector.unregister(key.fileobj)
    os.close(key.fd)
    _, status = os.waitpid(leader, 0)
    _send(conn, SpawnReply(returncode=os.waitstatus_to_exitcode(status)))
    conn.close()


def _send(conn: socket.socket, reply: SpawnReply) -> bool:
    try:
        conn.sendall(reply.model_dump_json(exclude_none=True).encode() + b"\n")
        return True
    except OSError:
        return False


def lead(request: SpawnRequest, zygote: int) -> NoReturn:
    """The group leader (a fork of the zygote): fork the ranks, watch them, exit as torchrun would."""
    os.setsid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != zygote:  # the zygote died before the line above
        os._exit(1)
    log = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's sockets
    os.write(1, f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {request.banner} (forked by the zygote)\n".encode())
    ranks: dict[int, int] = {}

    def forward(signum, frame) -> None:
        for pid in ranks:
            _signal(pid, signal.SIGTERM)

    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # no handler of ours may run in a rank
    for sig in FORWARDED:
        signal.signal(sig, forward)
    leader = os.getpid()
    for rank in range(request.ranks):
        pid = os.fork()
        if pid == 0:
            run_rank(request, rank, leader)
        ranks[pid] = rank
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os._exit(_watch(ranks))


def _watch(ranks: dict[int, int]) -> int:
    failed: int | None = None
    deadline = None
    while ranks:
        pid, status = os.waitpid(-1, 0 if deadline is None else os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for left in ranks:
                    _signal(left, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rank = ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is None or code == 0 or failed is not None:
            continue
        failed = code if code > 0 else 128 - code
        print(f"zygote leader: rank {rank} (pid {pid}) exited with {code}; ending the group's other ranks", flush=True)
        for left in ranks:
            _signal(left, signal.SIGTERM)
        deadline = time.monotonic() + RANK_GRACE_S
    return failed or 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_rank(request: SpawnRequest, rank: int, leader: int) -> NoReturn:
    """A rank (a fork of the leader): torchrun's environment, then the trainer, then exit."""
    forked_at = time.time()
    code: int = 1
    try:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        die_with_parent(signal.SIGKILL)
        if os.getppid() != leader:
            os._exit(1)
        os.environ.clear()
        os.environ.update(rank_env(request.env, rank, request.ranks, request.master_addr, request.master_port))
        sys.argv = ["trainer", *request.trainer_args]
        from trainer.__main__ import main

        code = main(request.trainer_args, forked_at, forked=True)
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:  # noqa: BLE001  whatever the trainer raised, the rank leaves with a code
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        fail("trainer.zygote", "usage: python -m trainer.zygote SOCKET -- TRAINER_ARGS")
    path, trainer_args = Path(argv[0]), argv[2:]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        took = preload(trainer_args)
    except ConfigError as err:
        fail("trainer.zygote", str(err))
    if (count := threads()) != 1:
        fail("trainer.zygote", f"{count} threads after the imports: forking would copy their locks held; "
             "start groups with torchrun instead", code=1)
    print(f"{READY_LINE} in {took:.1f}s (pid {os.getpid()}, socket {path})", flush=True)
    serve(path)


if __name__ == "__main__":
    main(sys.argv[1:])
