"""The collective watch: its decisions on recorded rounds, then the watch itself against a real
torchft Lighthouse and real sockets standing for a peer's Manager (the network cut itself is
in tests/multihost)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torchft._torchft import LighthouseClient

from cluster import wait_for
from protocol.lighthouse import status_url
from protocol.lighthouse_status import fetch_status
from trainer.collective_watch import (
    GRACE_FLOOR_S,
    CollectiveWatch,
    PeerLost,
    Round,
    cut_off,
    grace_s,
    lost_members,
    stays_out_for,
)

ME, PEER = "group0:mine", "group1:peer"


def test_a_peer_is_lost_only_after_two_failed_probes_in_a_row():
    refused = Round(unreached={PEER: "ECONNREFUSED"})
    assert lost_members([refused]) == {}, "one lost SYN does not repeat"
    assert lost_members([refused, Round(), refused]) == {}, "reached in between"
    assert list(lost_members([Round(), refused, refused])) == [PEER]


def test_a_stale_heartbeat_is_evidence_only_while_the_lighthouse_hears_this_group():
    stale = Round(stale=frozenset({PEER}), self_fresh=True)
    assert lost_members([Round(), stale]) == {}, "a heartbeat late once: a starved peer, maybe"
    assert lost_members([stale, stale]) == {PEER: "the Lighthouse stopped hearing its heartbeat"}
    starved = Round(stale=frozenset({PEER}), self_fresh=False)
    assert lost_members([stale, starved]) == {}, "a starved Lighthouse marks everyone old"


def test_only_the_network_keeps_a_group_out_and_only_from_a_lower_numbered_peer_still_heard():
    cut = Round(unreached={PEER: "EINVAL"}, cut=frozenset({PEER}), self_fresh=True)
    assert cut_off([cut, cut]) == {PEER: "EINVAL"}
    assert cut_off([cut]) == {}, "two rounds"
    refused = Round(unreached={PEER: "ECONNREFUSED"}, self_fresh=True)
    assert cut_off([refused, refused]) == {}, "a refusal: its host is reached, its process died"
    gone = Round(unreached={PEER: "EINVAL"}, cut=frozenset({PEER}), stale=frozenset({PEER}), self_fresh=True)
    assert cut_off([cut, gone]) == {}, "the Lighthouse no longer hears it: its next quorum leaves it out anyway"
    assert stays_out_for(2, 1) and not stays_out_for(1, 2) and not stays_out_for(None, 1)


def test_probing_starts_after_a_few_recent_medians_and_never_sooner_than_the_floor():
    assert grace_s([]) == GRACE_FLOOR_S
    assert grace_s([0.01, 0.02, 0.03]) == GRACE_FLOOR_S
    assert grace_s([0.4, 0.5, 9.0]) == pytest.approx(1.5)


class Peer:
    """A peer group's Manager as the watch sees it: a listening socket, heartbeats to the Lighthouse."""

    def __init__(self, lighthouse: str, replica_id: str):
        self.lighthouse = lighthouse
        self.replica_id = replica_id
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.beating = True
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        client = LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=5))
        while self.beating:
            client.heartbeat(self.replica_id)
            time.sleep(0.05)

    def quorum(self) -> None:
        client = LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=5))
        client.quorum(replica_id=self.replica_id, timeout=timedelta(seconds=10), address=self.address,
                      store_address="127.0.0.1:1", step=1, world_size=1)

    def die(self) -> None:
        """Its process is gone: no heartbeat, and its host refuses the port."""
        self.beating = False
        self.sock.close()
        self._thread.join()


@pytest.fixture
def quorum(lighthouse):
    """Two members, ``ME`` and ``PEER``, in one real quorum of the Lighthouse."""
    me, peer = Peer(lighthouse, ME), Peer(lighthouse, PEER)
    wait_for(lambda: {h.replica_id for h in fetch_status(status_url(lighthouse), 5).heartbeats} == {ME, PEER}, 10,
             "both heartbeats at the Lighthouse")  # else the first to ask gets a quorum of one, and the other none
    joins = [threading.Thread(target=p.quorum) for p in (me, peer)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    yield lighthouse, me, peer
    for p in (me, peer):
        if p.beating:
            p.die()


@pytest.fixture
def watched(quorum):
    """A watch of ``ME``'s waits in that quorum, the errors it aborted with, and ``PEER``."""
    lighthouse, _, peer = quorum
    aborted: list[Exception] = []
    watch = CollectiveWatch(status_url(lighthouse), members=lambda: [ME, PEER], self_id=lambda: ME,
                            abort=aborted.append)
    yield watch, aborted, peer
    watch.close()


def test_a_new_quorums_addresses_are_learned_at_its_first_wait_before_anything_is_probed(watched):
    watch, aborted, _ = watched
    with watch.waiting():
        time.sleep(GRACE_FLOOR_S / 2)  # ends before anything is probed
    wait_for(lambda: PEER in watch.addresses, 5, "the peer's address, read at the quorum's first wait")
    assert watch.addresses[PEER][0] == "127.0.0.1" and aborted == []


def test_a_slow_wait_on_a_live_peer_is_never_ended(watched):
    watch, aborted, _ = watched
    with watch.waiting():
        time.sleep(2.0)  # four times the grace: probed several times, reached every time
    assert aborted == []
    assert watch.addresses[PEER][0] == "127.0.0.1", "the peer's Manager address, read from the Lighthouse"


def test_a_wait_on_a_dead_peer_ends_within_about_a_second_and_says_which(watched):
    watch, aborted, peer = watched
    with watch.waiting():
        time.sleep(0.2)
    peer.die()
    start = time.monotonic()
    with watch.waiting():
        while not aborted and time.monotonic() - start < 5:
            time.sleep(0.01)
    ended_s = time.monotonic() - start
    [err] = aborted
    assert isinstance(err, PeerLost) and "group 1" in str(err), err
    assert ended_s < 2.0, f"ended after {ended_s:.1f} s"
    assert watch.hold_back(5.0, lambda: False, print) == 0.0, "refused: its host is reached, nothing to wait for"


def test_an_abort_never_lands_after_the_wait_it_watched(watched):
    watch, aborted, peer = watched
    peer.die()
    with watch.waiting():
        time.sleep(GRACE_FLOOR_S * 0.8)  # ends before the watch probes
    time.sleep(1.5)
    assert aborted == [], "the next step's collectives are not this wait's to end"
