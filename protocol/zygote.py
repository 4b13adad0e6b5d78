"""How an agent asks its zygote to fork a replica group: one request and two answers on a Unix socket.

The zygote (``python -m trainer.zygote``) is a process of the agent's that has imported torch,
torchft and the model code, and read the corpus, once. For each group start the agent connects,
writes one :class:`SpawnRequest` line and reads two :class:`SpawnReply` lines: the group leader's
pid at once, its exit code when it ends. The leader is the zygote's fork; it forks the group's
ranks with the environment torchrun gives them (:func:`protocol.torchrun.rank_env`) and watches
them as ``torchrun --max-restarts=0`` does. Closing the connection does not end the group; the
agent ends groups by signals, as it does a torchrun tree.

The socket lives in a private folder (0700) the agent makes for it under the temporary folder (a
socket's path is limited to 107 bytes, which a state folder's may pass) and is 0600 itself:
whoever may connect may run the trainer as this user, who may start the agent anyway.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

READY_LINE = "zygote ready"
"""Printed (with the imports' seconds) once the socket accepts connections."""


class SpawnRequest(BaseModel):
    trainer_args: list[str] = Field(description="the trainer's flags, as `python -m trainer` takes them")
    ranks: int = Field(ge=1, le=4096, description="ranks to fork (torchrun's --nproc-per-node)")
    master_addr: str = Field(description="where rank 0's store listens (torchrun's --master-addr)")
    master_port: int = Field(ge=1, le=65535)
    env: dict[str, str] = Field(description="the ranks' environment before the rank's own variables")
    log_path: str = Field(description="the leader's and the ranks' stdout and stderr are appended here")
    banner: str = Field(description="a line written to the log before the group starts")


class SpawnReply(BaseModel):
    pid: int | None = Field(None, description="first answer: the group leader's pid")
    returncode: int | None = Field(None, description="second answer: the leader's exit code (negative: killed by that signal)")
    error: str | None = Field(None, description="instead of a pid: why the zygote could not fork the group")
