"""Every second of a group's return, from its restart to its first committed step after the heal.

A rejoin is a chain of instants, read from the group's own events: it was restarted (its agent's
``started`` process event, or the drill's request) → rank 0's process began (its start event's
``ts`` less its stages) → each startup stage ended → the start event → its Manager's quorum
answered (``HealEvent.quorum_at``) → torchft called the transport (``fetch_started_at``) → the
header was read → the bytes arrived → the healing step reached its commit point → the state was
applied (``applied_at``) → the group's first committed step. :func:`recovery_phases` turns the
chain into :class:`RecoveryPhase` rows, each the time between two consecutive instants, so the
rows add up to the whole; ``verify`` (the checksums, computed as the bytes arrive) is a part of
``transfer`` and is not added. A warm spare built everything before the fault: its rows start
at its promotion. The kill-heal drills' reports, the page and ``ftctl_heal_phase_seconds`` all
read it from here.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from protocol.events import HealEvent, StartEvent

PHASES: dict[str, str] = {
    "process_start": "process start",
    "process_group": "process group",
    "data": "data",
    "model_build": "model build",
    "checkpoint_lookup": "checkpoint lookup",
    "manager": "Manager",
    "quorum_wait": "quorum wait",
    "metadata": "metadata",
    "transfer": "transfer",
    "verify": "verify",
    "healing_step": "healing step",
    "apply": "apply",
    "first_commit": "first committed step",
}
"""Each phase's name (a metric label) and how a person reads it, in the order they happen."""


class RecoveryPhase(BaseModel):
    phase: str = Field(description="one of recovery.PHASES: a metric label")
    label: str = Field(description="how a person reads it")
    seconds: float
    detail: str | None = None
    within: str | None = Field(None, description="the phase this one is part of (not added to the total)")


def _phase(phase: str, seconds: float, **more: str | None) -> RecoveryPhase:
    return RecoveryPhase(phase=phase, label=PHASES[phase], seconds=seconds, **more)


def _process_start_detail(start: StartEvent) -> str:
    if start.spare_wait_s:
        return f"a warm spare promoted (built {start.spare_wait_s:.0f} s before)"
    return "forked from the agent's zygote" if start.forked else "a cold start, imports included"


def _startup(rejoined_at: float | None, start: StartEvent) -> list[RecoveryPhase]:
    if start.spare_wait_s:  # everything but the Manager was built before the fault
        stages = [("manager", start.manager_s)]
    else:
        stages = [("process_group", start.process_group_s), ("data", start.data_s), ("model_build", start.model_s),
                  ("checkpoint_lookup", start.checkpoint_s), ("manager", start.manager_s)]
    began = start.ts - sum(seconds for _, seconds in stages)
    phases = [_phase("process_start", began - rejoined_at, detail=_process_start_detail(start))] \
        if rejoined_at is not None else []
    return phases + [_phase(name, seconds) for name, seconds in stages]


def recovery_phases(rejoined_at: float | None, start: StartEvent | None, heal: HealEvent | None,
                    committed_at: float | None = None) -> list[RecoveryPhase]:
    """The phases the known instants bound, in order. Without a start event (ranks that were
    never restarted, as a partition's) the heal's phases alone; a heal event from an older
    trainer has no times: the phases stop at the start."""
    phases: list[RecoveryPhase] = []
    if start is not None:
        phases += _startup(rejoined_at, start)
    if heal is None or None in (heal.quorum_at, heal.fetch_started_at, heal.applied_at):
        return phases
    if start is not None:
        phases.append(_phase("quorum_wait", heal.quorum_at - start.ts))
    header_read = heal.fetch_started_at + heal.header_s
    arrived = header_read + heal.transfer_s
    apply_started = heal.applied_at - heal.load_s
    rate = heal.bytes / 2**30 / heal.transfer_s if heal.transfer_s else 0.0
    sources = ", ".join(map(str, heal.sources or [heal.source_group]))
    phases += [
        _phase("metadata", header_read - heal.quorum_at,
               detail=f"torchft's metadata call {heal.fetch_started_at - heal.quorum_at:.2f} s, "
               f"sources and header {heal.header_s:.2f} s"),
        _phase("transfer", heal.transfer_s,
               detail=f"{heal.bytes / 2**20:.1f} MiB at {rate:.2f} GiB/s from group(s) {sources}"
               + (f", {heal.source_failures} dropped mid-heal" if heal.source_failures else "")),
        _phase("verify", heal.checksum_s, within="transfer",
               detail="CRC-32C of every segment as it arrived (CPU time, all sources)"),
        _phase("healing_step", apply_started - arrived,
               detail="the step's forward and backward (not counted) until its commit point"),
        _phase("apply", heal.load_s),
    ]
    if committed_at is not None:
        phases.append(_phase("first_commit", committed_at - heal.applied_at))
    return phases


def total_s(phases: list[RecoveryPhase]) -> float:
    """What the phases add up to (the parts of another phase not counted)."""
    return sum(p.seconds for p in phases if p.within is None)
