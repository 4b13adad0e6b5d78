"""The agent's side of its zygote (:mod:`trainer.zygote`): keep it running, ask it for groups.

A group the zygote forks is handed to the supervisor as a :class:`ForkedGroup`, which answers
what the supervisor asks of a torchrun ``Popen``: its pid, whether and how it ended. Its process
tree (leader and ranks) is signalled, stopped and killed exactly as a torchrun tree is.

When the zygote cannot fork (it never became ready, or it died and its successor is not ready
in time), :meth:`Zygote.spawn` answers None and the group starts with torchrun, cold, as
without a zygote: a start is never refused because the faster path is missing.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from protocol.layout import GroupLayout
from protocol.torchrun import torchrun_env
from protocol.zygote import SpawnReply, SpawnRequest
from service.proctree import REAPED_S, end_tree, wait_gone

log = logging.getLogger("agent.zygote")
READY_TIMEOUT_S = 120.0
"""How long a start waits for a zygote still importing (3.5 s on an idle core; much longer when
every core is busy) before it starts the group with torchrun instead."""
STOP_TIMEOUT_S = 5.0


class ForkedGroup:
    """A group leader forked by the zygote, seen as the part of ``subprocess.Popen`` the
    supervisor uses. Its exit code arrives on the spawn connection; when the connection breaks
    instead, the zygote died and took the leader with it (``PR_SET_PDEATHSIG``): SIGKILL."""

    def __init__(self, pid: int, conn: socket.socket, reader: BinaryIO):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._await_exit, args=(conn, reader), name=f"forked-{pid}", daemon=True).start()

    def _await_exit(self, conn: socket.socket, reader: BinaryIO) -> None:
        code = None
        try:
            code = SpawnReply.model_validate_json(reader.readline()).returncode
        except (OSError, ValidationError):
            pass
        finally:
            reader.close()
            conn.close()
        if code is None:
            wait_gone([self.pid], REAPED_S)
            code = -signal.SIGKILL
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"group leader {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]  # set before the event


class Zygote:
    """One group's zygote process: started with the agent, started again when it dies."""

    def __init__(self, group: int, trainer_args: list[str], log_path: Path, ready_timeout_s: float = READY_TIMEOUT_S):
        self.group = group
        self.socket_path: Path | None = None
        self.trainer_args = trainer_args
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the zygote unless it runs; it imports in the background and is ready when its socket appears."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            if self.proc is not None:
                log.warning("the zygote (pid %d) exited with %s; starting another", self.proc.pid, self.proc.returncode)
            if self.socket_path is None or not self.socket_path.parent.is_dir():
                self.socket_path = Path(tempfile.mkdtemp(prefix=GroupLayout(self.group).zygote_dir_prefix)) / "socket"
            self.socket_path.unlink(missing_ok=True)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as out:
                out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting the zygote\n".encode())
                out.flush()
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "trainer.zygote", str(self.socket_path), "--", *self.trainer_args],
                    env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                return False
            if self.socket_path is not None and self.socket_path.exists():
                return True
            time.sleep(0.02)
        return False

    def spawn(self, banner: str, trainer_args: list[str], ranks: int, master_addr: str, master_port: int,
              log_path: Path) -> ForkedGroup | None:
        """Fork a group; None when the zygote cannot (the caller starts the group with torchrun)."""
        self.start()
        if not self._wait_ready():
            log.warning("the zygote is not ready (see %s): starting the group with torchrun", self.log_path)
            return None
        request = SpawnRequest(trainer_args=trainer_args, ranks=ranks, master_addr=master_addr,
                               master_port=master_port, env=torchrun_env(), log_path=str(log_path), banner=banner)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
            conn.sendall(request.model_dump_json().encode() + b"\n")
            reader = conn.makefile("rb")
            reply = SpawnReply.model_validate_json(reader.readline())
        except (OSError, ValidationError) as err:
            conn.close()
            log.warning("the zygote did not fork the group (%s): starting it with torchrun", err)
            return None
        if reply.pid is None:
            reader.close()
            conn.close()
            log.warning("the zygote refused: %s; starting the group with torchrun", reply.error)
            return None
        return ForkedGroup(reply.pid, conn, reader)

    def stop(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            end_tree(proc, STOP_TIMEOUT_S)
        if self.socket_path is not None:
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)
