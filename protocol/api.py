"""The control plane's REST API: where each operation lives.

Every path here is relative to :data:`PREFIX`, which is set once on each side: where the control
plane mounts its routers (``service/controlplane/app.py``) and in the client every other process
uses (``service/client.py``: ``ftctl``, the benches, the tests). The request and response bodies
are the control plane's models (``service/controlplane/models.py``, and each drill kind's own in
``service/controlplane/drills/``); the agents' own contracts are ``protocol/ingest.py`` and
``protocol/registration.py``.
"""

from __future__ import annotations

PREFIX = "/api/v1"

QUORUM = "/quorum"
GROUPS = "/groups"
GROUP = "/groups/{group}"
GROUP_AGENT = "/groups/{group}/agent"
GROUP_KILL = "/groups/{group}/kill"
GROUP_REJOIN = "/groups/{group}/rejoin"
GROUP_EVICT = "/groups/{group}/evict"
GROUP_DRAIN = "/groups/{group}/drain"
EVENTS = "/events"
EVENTS_STREAM = "/events/stream"
DRILLS = "/drills"
DRILL_KINDS = "/drills/kinds"
DRILL = "/drills/{drill_id}"
DATA = "/data"
GOODPUT = "/goodput"
SDC = "/sdc"
STRAGGLERS = "/stragglers"
AGENTS = "/agents"
AGENT = "/agents/{group}"
INGEST = "/ingest/{group}"
INGEST_STREAM = "/ingest/{group}/stream"


def url(path: str, **params: object) -> str:
    """The full path of ``path`` (one of this module's), its ``{params}`` filled in."""
    return PREFIX + path.format(**params)
