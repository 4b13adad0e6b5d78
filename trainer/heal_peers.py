"""The live peers a healing rank can fetch its state from, besides the one torchft names.

torchft's quorum answer names one source group per healing rank; every group whose step is the
quorum's holds the same state. The Lighthouse's status page lists the quorum's members with their
step and Manager address (``protocol/lighthouse_status.py`` reads it); each Manager answers, for a
group rank, that rank's checkpoint metadata: the heal address of its
:class:`~trainer.heal_transport.StreamTransport`. :class:`LighthousePeers` is the
transport's ``peers`` function; ``groups`` maps each address it found to its group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta

from torchft._torchft import ManagerClient

from protocol.lighthouse import status_url
from protocol.lighthouse_status import fetch_status

LOOKUP_TIMEOUT = timedelta(seconds=2)
"""The most finding extra sources may add to a heal: torchft's own source needs no lookup."""


class LighthousePeers:
    def __init__(self, lighthouse: str, group_rank: int, timeout: timedelta = LOOKUP_TIMEOUT):
        self.status_url = status_url(lighthouse)
        self.group_rank = group_rank
        self.timeout = timeout
        self.groups: dict[str, int | None] = {}

    def _heal_address(self, manager_address: str) -> str:
        client = ManagerClient(manager_address, connect_timeout=self.timeout)
        return client._checkpoint_metadata(self.group_rank, timeout=self.timeout)

    def __call__(self, step: int) -> list[str]:
        """The heal addresses of this rank's peers in every quorum member at ``step``, asked of
        their Managers at once; a member that does not answer in time is left out."""
        status = fetch_status(self.status_url, self.timeout.total_seconds())
        members = [m for m in status.members if m.step == step]
        if not members:
            return []
        pool = ThreadPoolExecutor(len(members), thread_name_prefix="heal-peers")
        asked = {pool.submit(self._heal_address, m.manager_address): m for m in members}
        found = []
        try:
            for done in as_completed(asked, timeout=self.timeout.total_seconds()):
                if done.exception() is None:  # a member gone since the quorum: the others are enough
                    self.groups[done.result()] = asked[done].group
                    found.append(done.result())
        except FuturesTimeout:
            pass
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return found
