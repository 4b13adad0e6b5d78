"""What every service's ``/healthz`` carries, so a launcher can tell who answered."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


class Served(BaseModel):
    """``server_pid``: the process that answered. A launcher that started a service checks it: an
    answer from another process on that port is an older job's, not the one it just started."""

    ok: bool
    server_pid: int = Field(default_factory=os.getpid, description="the process that answered")
