"""``--straggler-policy evict``: ends a persistent straggler when keeping it costs more.

The detector (``stragglers.py``) decides and says so in its ``flagged`` event
(``policy_action``); this task, listening on the bus, carries out an ``evict``: the group's
agent ends it (down, reason ``evicted``), and when the agent keeps a ready warm spare the
spare takes its place at once. Without one the group stays down until someone rejoins it: its
agent does not restart an evicted group by itself (the same slow node would be flagged again).
While a drill other than the straggler drill holds the groups, nothing is evicted.
"""

from __future__ import annotations

import logging

from protocol.events import StragglerEvent
from service.controlplane.bus import EventBus
from service.controlplane.errors import DomainError
from service.controlplane.group_control import GroupControl

log = logging.getLogger("controlplane.stragglers")


class StragglerResponder:
    def __init__(self, bus: EventBus, control: GroupControl):
        self.bus = bus
        self.control = control

    async def run(self) -> None:
        queue = self.bus.subscribe()
        try:
            while True:
                e = (await queue.get()).event
                if isinstance(e, StragglerEvent) and e.action == "flagged" and e.policy_action == "evict":
                    await self.evict(e.group)
        finally:
            self.bus.unsubscribe(queue)

    async def evict(self, group: int) -> None:
        drill = self.control.holder if self.control.holder_kind == "straggler" else None
        try:
            eviction = await self.control.evict(group, drill_id=drill)
        except DomainError as err:
            log.warning("not evicting straggler group %d: %s", group, err)
            return
        log.warning("evicted straggler group %d%s", group, "; its warm spare takes its place" if eviction.replaced_by_spare else "")
