"""A replica group's identity as torchft sees it, and back.

torchft names a group's Manager ``"{replica_id}:{uuid}"`` with a new uuid on every start. The
trainer passes ``replica_name(g)`` as the replica id, so the stable group id g can be read back
from any name the Lighthouse reports: the API, metrics and events use g, never the uuid.
"""

from __future__ import annotations

import re

REPLICA_NAME_PREFIX = "group"
_TRAILING_DIGITS = re.compile(r"(\d+)$")


def replica_name(group: int) -> str:
    """The replica id a group's Manager registers with (torchft appends ``:uuid``)."""
    return f"{REPLICA_NAME_PREFIX}{group}"


def group_of(replica_id: str) -> int | None:
    """The stable group id in ``group3:5f0c…`` (3), or None for a name this service did not give."""
    match = _TRAILING_DIGITS.search(replica_id.split(":", 1)[0])
    return int(match.group(1)) if match else None
