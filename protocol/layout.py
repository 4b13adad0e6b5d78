"""Where a group's files are: every per-group file name of every process is made here.

One prefix, ``g{group}``. The folders are the caller's: the events folder (the ranks write their
events and beacons there, the agent tails them and keeps its own events, its forwarding offsets
and a drill's injection there), the agent's run folder (pid files, warm-spare handshakes, a
network cut's record), the logs folder, and the checkpoint folder (a group's staging copies).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupLayout:
    group: int

    @property
    def prefix(self) -> str:
        return f"g{self.group}"

    # the events folder
    def rank_events(self, rank: int | str) -> str:
        """A rank's events, one JSON object per line (``protocol/events.py``)."""
        return f"{self.prefix}-r{rank}.jsonl"

    @property
    def agent_events(self) -> str:
        """The agent's own events (process started, killed, …)."""
        return f"{self.prefix}-agent.jsonl"

    @property
    def events_glob(self) -> str:
        """Every events file of the group: its ranks' and its agent's."""
        return f"{self.prefix}-*.jsonl"

    def beacon(self, rank: int) -> str:
        """A rank's liveness beacon, rewritten in place (``protocol/beacon.py``)."""
        return f"{self.prefix}-r{rank}.beacon"

    @property
    def shipped(self) -> str:
        """How far the agent has forwarded each events file."""
        return f"{self.prefix}.shipped"

    @property
    def injection(self) -> str:
        """A drill's fault for the group's ranks (``protocol/injection.py``)."""
        return f"{self.prefix}.inject"

    @property
    def quarantine(self) -> str:
        """Why the group's ranks quarantined themselves (``protocol/quarantine.py``)."""
        return f"{self.prefix}.quarantine"

    def event_ids(self, rank: int | None) -> str:
        """The prefix of the event ids a rank (or the agent: None) gives its events."""
        return f"{self.prefix}.agent" if rank is None else f"{self.prefix}.r{rank}"

    # the agent's run folder
    @property
    def pid(self) -> str:
        return f"{self.prefix}.pid"

    @property
    def spare_pid(self) -> str:
        return f"{self.prefix}.spare.pid"

    def promotion(self, generation: int) -> str:
        """The file that promotes warm spare ``generation`` (``protocol/spare.py``)."""
        return f"{self.prefix}.promote.{generation}"

    @property
    def promotion_glob(self) -> str:
        return f"{self.prefix}.promote.*"

    @property
    def cut(self) -> str:
        """A network cut the agent made, so a restarted agent can undo it."""
        return f"{self.prefix}.cut.json"

    # the logs folder
    @property
    def log(self) -> str:
        return f"{self.prefix}.log"

    # elsewhere
    @property
    def zygote_dir_prefix(self) -> str:
        return f"ftctl-zygote-{self.prefix}-"

    def checkpoint_staging(self, final: str) -> str:
        """Where the group writes checkpoint ``final`` before it renames it into place."""
        return f".{final}.tmp-{self.prefix}"

    @property
    def checkpoint_staging_glob(self) -> str:
        return f".step-*.tmp-{self.prefix}"

    def checkpoint_replaced(self, final: str) -> str:
        """Where the group moves an older checkpoint ``final`` it replaces, until the new one is in place."""
        return f".{final}.old-{self.prefix}"
