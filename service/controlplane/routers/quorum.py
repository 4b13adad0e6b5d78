from __future__ import annotations

from fastapi import APIRouter

from protocol import api
from service.controlplane.deps import AuthorizedDep, ServicesDep
from service.controlplane.presenters import group_out, redacted
from service.controlplane.lighthouse import LighthouseUnreachable
from service.controlplane.models import HeartbeatOut, QuorumMemberOut, QuorumOut

router = APIRouter(tags=["quorum"])


@router.get(api.QUORUM, response_model=QuorumOut)
async def quorum(s: ServicesDep, authorized: AuthorizedDep) -> QuorumOut:
    """The quorum as the Lighthouse sees it (asked at most ``--quorum-view-max-age-s`` ago, once
    for every viewer), joined with what each group last reported. Full
    replica ids, Manager and store addresses (what torchft's unauthenticated kill paths take)
    and the raw status come only with the job's token."""
    groups = [group_out(v) for v in s.board.views.values()]
    try:
        status = await s.lighthouse.recent_status(s.settings.quorum_view_max_age_s)
    except LighthouseUnreachable as err:
        return QuorumOut(lighthouse_reachable=False, lighthouse_error=str(err), groups=groups)
    by_group = {g.group: g for g in groups}
    shown = (lambda fields: fields) if authorized else redacted
    members = []
    for m in status.members:
        view = by_group.get(m.group) if m.group is not None else None
        members.append(QuorumMemberOut(
            **shown(m.model_dump()), state=view.state if view else None,
            last_reported_step=view.step if view else None, participants=view.participants if view else None,
        ))
    return QuorumOut(
        lighthouse_reachable=True, quorum_id=status.quorum_id, next_quorum_status=status.next_quorum.text,
        heartbeating=status.next_quorum.heartbeating, members=members,
        heartbeats=[HeartbeatOut(**shown(h.model_dump())) for h in status.heartbeats], groups=groups,
        raw=status if authorized else None,
    )
