"""What the API shows of the control plane's own state: a group's view, a record without its secrets."""

from __future__ import annotations

from service.controlplane.groups import GroupView
from service.controlplane.models import GroupOut, HealOut, SdcIncidentOut, StragglerOut, SyncOut, TransitionOut

SECRET_FIELDS = ("replica_id", "manager_address", "store_address")


def redacted(fields: dict) -> dict:
    """A record as an unauthenticated reader sees it: without the fields in :data:`SECRET_FIELDS`."""
    return {k: (None if k in SECRET_FIELDS else v) for k, v in fields.items()}


def group_out(view: GroupView, with_transitions: bool = False) -> GroupOut:
    t = view.transition
    heal = view.last_heal
    flag, sdc, sync = view.straggler, view.last_sdc, view.last_sync
    return GroupOut(
        group=view.group, state=view.state, down_reason=view.down_reason, down_detail=view.down_detail,
        since=t.ts if t else None, step=view.step, loss=view.loss, diverged=view.diverged, participants=view.participants,
        quorum_id=view.quorum_id, step_s=view.step_s, last_event_ts=view.last_event_ts,
        last_heal=HealOut(ts=heal.ts, step=heal.step, source_group=heal.source_group, bytes=heal.bytes,
                          fetch_s=heal.fetch_s, load_s=heal.load_s) if heal else None,
        pid=view.pid, restarts=max(0, view.starts - 1),
        straggler=StragglerOut(since=flag.ts, slowdown=flag.slowdown, relative=flag.relative,
                               individual=flag.individual, policy_action=flag.policy_action, detail=flag.detail)
        if flag else None,
        last_sdc=SdcIncidentOut(ts=sdc.ts, step=sdc.step, verdict=sdc.verdict, action=sdc.action,
                                norm=sdc.norms.get(view.group), reference_norm=sdc.reference_norm) if sdc else None,
        last_sync=SyncOut(ts=sync.ts, step=sync.step, outer_step=sync.outer_step, committed=sync.committed,
                          seconds=sync.seconds, bytes=sync.bytes, drift=sync.drift, participants=sync.participants)
        if sync else None,
        transitions=[TransitionOut(state=h.state, reason=h.reason, ts=h.ts) for h in view.history]
        if with_transitions else None,
    )
