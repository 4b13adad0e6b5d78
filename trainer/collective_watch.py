"""A network cut costs the survivors about a second, not the collective timeout.

**Inside a collective.** A cross-group all-reduce that a peer stops feeding (its host cut off,
its link blackholed, its node gone without a FIN reaching us) waits out ``--timeout-s`` (10 s)
in every survivor: a ring all-reduce stalls as a whole. Cutting the timeout instead would end
healthy collectives that are merely slow: a peer healing, saving a checkpoint, straggling, or
starved of a core. So :class:`CollectiveWatch` ends a wait only on evidence that a peer of the
step's quorum is lost, never on time alone (:func:`lost_members`):

- its host does not take a connection to its Manager's port, :data:`ROUNDS` probes in a row
  (a blackhole route fails at once, a dropped packet after :data:`CONNECT_TIMEOUT_S`, a dead
  process is refused); a live peer's kernel answers a connection even when its process is
  starved or busy, so slowness is never taken for loss;
- or the Lighthouse marks its heartbeat old while it marks this group's fresh, as many rounds in
  a row (a Lighthouse that is itself starved marks everyone old: no evidence).

Probing starts once a wait has lasted :func:`grace_s` (a few times its recent median, at least
:data:`GRACE_FLOOR_S`), so healthy steps cost nothing. The abort is torchft's ``report_error``
on :class:`~trainer.fault_tolerance.FailFastManager`, which ends the step's connections: every
survivor's collective fails within milliseconds and they meet at the next quorum. It is given
only while the wait it watched is still in progress, under the lock that wait's end takes, so it
can never land in a later step or quorum. ``--timeout-s`` stays the last line: a peer that is
reachable and heartbeats but never sends is still waited for that long.

**After it.** Two groups that cannot reach each other both still heartbeat, so torchft's next
quorum takes them both again and their process group's connect waits out the timeout (measured:
10 s, then the same again). So after a failed step :meth:`CollectiveWatch.hold_back` keeps a
group out of the next quorum while a lower-numbered member of the last one is cut off from it
(the network, not a refusal: a refused peer died and its heartbeat ends by itself): the others
form a quorum without it after the Lighthouse's join timeout, as the control plane's partition
rule would decide (it keeps the lower numbers, ``service/controlplane/partition.py``), and it
rejoins, and heals, once it reaches the peer again or the Lighthouse stops hearing the peer.
That needs no control plane: with one, its responder also evicts the same group.
"""

from __future__ import annotations

import errno
import logging
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from protocol.lighthouse import LighthouseStatus, lighthouse_endpoint
from protocol.lighthouse_status import fetch_status
from protocol.replicas import group_of

log = logging.getLogger("trainer.collective_watch")

GRACE_FLOOR_S = 0.5
"""A wait shorter than this is never probed."""
GRACE_MEDIANS = 3.0
"""A wait is probed once it lasts this many times the median of the recent ones."""
RECENT_WAITS = 20
PROBE_EVERY_S = 0.25
CONNECT_TIMEOUT_S = 0.5
"""A peer's host that takes no connection within this is not reached this round."""
STATUS_TIMEOUT_S = 0.5
ROUNDS = 2
"""Probe rounds in a row a peer must fail: a cut persists; one lost SYN does not repeat."""
MAX_PROBES = 32


class PeerLost(RuntimeError):
    """A peer of the step's quorum is lost: the step's cross-group collective was ended."""


@dataclass(frozen=True)
class Round:
    """One round's evidence about some members of the quorum (replica ids)."""

    unreached: dict[str, str] = field(default_factory=dict)
    """member → why its host took no connection"""
    cut: frozenset[str] = frozenset()
    """the unreached members whose host the network does not reach (not a refusal)"""
    stale: frozenset[str] = frozenset()
    """members whose heartbeat the Lighthouse marks old (or never had)"""
    self_fresh: bool = False
    """the Lighthouse marks this group's own heartbeat fresh"""

    def heard(self, member: str) -> bool:
        """The Lighthouse still hears ``member``, as far as this round can tell."""
        return not (self.self_fresh and member in self.stale)


def grace_s(recent_waits: list[float]) -> float:
    """How long a wait runs before its peers are probed."""
    return max(GRACE_FLOOR_S, GRACE_MEDIANS * statistics.median(recent_waits)) if recent_waits else GRACE_FLOOR_S


def lost_members(rounds: list[Round], rounds_needed: int = ROUNDS) -> dict[str, str]:
    """The members the evidence so far shows lost, each with why (oldest round first).

    A member is lost when, in each of the last ``rounds_needed`` rounds, its host took no
    connection, or the Lighthouse marked its heartbeat old while it marked ours fresh."""
    if len(rounds) < rounds_needed:
        return {}
    last = rounds[-rounds_needed:]
    lost = {m: f"its host took no connection {rounds_needed} times in a row ({why})"
            for m, why in last[-1].unreached.items() if all(m in r.unreached for r in last)}
    for member in sorted(last[-1].stale - lost.keys()):
        if all(not r.heard(member) for r in last):
            lost[member] = "the Lighthouse stopped hearing its heartbeat"
    return lost


def stays_out_for(mine: int | None, theirs: int | None) -> bool:
    """Whether a group cut off from a peer stays out of quorums until it reaches it again: the
    higher-numbered of the pair does, as the partition rule keeps the lower."""
    return mine is not None and theirs is not None and theirs < mine


def cut_off(rounds: list[Round], rounds_needed: int = ROUNDS) -> dict[str, str]:
    """The members the network kept from this group's reach in each of the last ``rounds_needed``
    rounds while the Lighthouse still heard them, with why."""
    if len(rounds) < rounds_needed:
        return {}
    last = rounds[-rounds_needed:]
    return {m: why for m, why in last[-1].unreached.items()
            if all(m in r.cut for r in last) and last[-1].heard(m)}


def describe(unreached: Mapping[str, str]) -> str:
    return "; ".join(f"group {group_of(m)} takes no connection ({why})" for m, why in sorted(unreached.items()))


NOT_THE_NETWORK = {errno.ECONNREFUSED, errno.ECONNRESET}
"""Errors of a host the network reaches: its process is gone, not the link."""


def _connect_error(host: str, port: int) -> tuple[str, bool] | None:
    """None when ``host:port`` takes a TCP connection; else why not, and whether the network is
    why (not a refusal from the host)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except TimeoutError:
        return f"no answer in {CONNECT_TIMEOUT_S:g} s", True
    except OSError as err:
        why = errno.errorcode.get(err.errno, str(err)) if err.errno else str(err)
        return why, err.errno not in NOT_THE_NETWORK


class CollectiveWatch:
    """Watches this rank's waits on cross-group collectives (:meth:`waiting`) and ends one whose
    quorum lost a peer; keeps the group out of quorums with a peer it is cut off from
    (:meth:`hold_back`). See the module's docstring.

    ``members`` gives the current quorum's replica ids, ``self_id`` this group's, ``abort``
    ends the step's collectives (torchft's ``report_error``), ``status_url`` is the
    Lighthouse's status page (members' Manager addresses and heartbeats)."""

    def __init__(self, status_url: str, members: Callable[[], list[str]], self_id: Callable[[], str],
                 abort: Callable[[Exception], None]):
        self.status_url = status_url
        self.members = members
        self.self_id = self_id
        self.abort = abort
        self.addresses: dict[str, tuple[str, int]] = {}
        """member → its Manager's host and port, as the Lighthouse last listed it"""
        self.recent: deque[float] = deque(maxlen=RECENT_WAITS)
        self._learned_for: tuple[str, ...] | None = None
        self.aborts = 0
        self._cond = threading.Condition()
        self._wait: int | None = None
        self._waits = 0
        self._since = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(MAX_PROBES, thread_name_prefix="collective-probe")
        self._thread = threading.Thread(target=self._run, name="collective-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on a cross-group collective of the current step."""
        with self._cond:
            self._waits += 1
            self._wait, self._since = self._waits, time.monotonic()
            aborts = self.aborts
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._wait = None
                if self.aborts == aborts:
                    self.recent.append(time.monotonic() - self._since)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        """Each wait is watched once: after its abort (or a probe that broke) it is left to end."""
        last: int | None = None
        while True:
            with self._cond:
                while (self._wait is None or self._wait == last) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                wait = last = self._wait
                probe_at = self._since + grace_s(list(self.recent))
            self._learn_new_members()
            with self._cond:
                while self._wait == wait and not self._closed and time.monotonic() < probe_at:
                    self._cond.wait(probe_at - time.monotonic())
                if self._wait != wait:
                    continue
            self._watch(wait)

    def _watch(self, wait: int) -> None:
        """Probe rounds until the wait ends or its quorum lost a peer."""
        rounds: list[Round] = []
        while True:
            started = time.monotonic()
            try:
                rounds.append(self._round(self._others()))
            except Exception:  # a probe that breaks must not end the trainer: the timeout still stands
                log.exception("probing the quorum's members failed")
                return
            lost = lost_members(rounds)
            with self._cond:
                if self._wait != wait or self._closed:
                    return
                if lost:
                    self._abort(lost)
                    return
                self._cond.wait(max(0.0, started + PROBE_EVERY_S - time.monotonic()))
                if self._wait != wait:
                    return

    def _abort(self, lost: Mapping[str, str]) -> None:
        """End the watched wait (called holding the lock its end takes)."""
        self.aborts += 1
        said = "; ".join(f"group {group_of(m)} ({m}): {why}" for m, why in sorted(lost.items()))
        waited = time.monotonic() - self._since
        log.warning("ending the step's cross-group collective after %.1f s: %s", waited, said)
        self.abort(PeerLost(f"lost a peer of the step's quorum after {waited:.1f} s in its collective: {said}"))

    def hold_back(self, limit_s: float, stopping: Callable[[], bool], say: Callable[[str], None]) -> float:
        """After a failed step, before the next quorum: while a lower-numbered member of the last
        quorum is cut off from this group (:func:`cut_off`, :func:`stays_out_for`), wait, at
        most ``limit_s`` (``--quorum-timeout-s``: past it, the quorum's own timeout decides) or
        until ``stopping``. Costs one connection per lower-numbered peer when nothing is cut.
        Returns the seconds held."""
        mine = group_of(self.self_id())
        peers = [m for m in self._others() if stays_out_for(mine, group_of(m))]
        if not peers:
            return 0.0
        start = time.monotonic()
        rounds = [self._round(peers)]
        if not rounds[-1].cut:
            return 0.0
        time.sleep(PROBE_EVERY_S)
        rounds.append(self._round(peers))
        held = cut_off(rounds)
        if not held:
            return 0.0
        say(f"staying out of the next quorum: {describe(held)}; the others train on, this group rejoins once it "
            "reaches it again")
        while held and not stopping() and time.monotonic() - start < limit_s:
            time.sleep(PROBE_EVERY_S)
            seen = self._round(list(held))
            held = {m: seen.unreached[m] for m in held if m in seen.cut and seen.heard(m)}
        held_s = time.monotonic() - start
        say(f"held out of the quorum {held_s:.1f} s: "
            + (f"still {describe(held)}, asking for a quorum anyway" if held else "rejoining"))
        return held_s

    def _others(self) -> list[str]:
        me = self.self_id()
        return [m for m in self.members() if m != me]

    def _learn_new_members(self) -> None:
        """Once per quorum, at its first wait: the addresses of members not known yet, read while
        the Lighthouse is surely there to ask (a cut may take it away from here later)."""
        try:
            members = tuple(self.members())
            if members != self._learned_for and any(m not in self.addresses for m in self._others()):
                self._learn_addresses()
            self._learned_for = members
        except Exception:  # never the watcher's end: the probes learn them later too
            log.exception("reading the quorum's members failed")

    def _learn_addresses(self) -> LighthouseStatus | None:
        """Read the Lighthouse's status page and keep its members' Manager addresses; None when
        the Lighthouse is away from here (or its page unreadable)."""
        try:
            status = fetch_status(self.status_url, STATUS_TIMEOUT_S)
        except (OSError, ValueError):
            return None
        for member in status.members:
            with suppress(ValueError):
                self.addresses[member.replica_id] = lighthouse_endpoint(member.manager_address)
        return status

    def _round(self, others: list[str]) -> Round:
        """Probe ``others`` (replica ids) and read the Lighthouse's heartbeats (when it is away, the
        probes still tell, at the addresses learned before)."""
        stale, self_fresh = frozenset(), False
        status = self._learn_addresses()
        if status is not None:
            beats = {h.replica_id: h for h in status.heartbeats}
            me = self.self_id()
            self_fresh = me in beats and not beats[me].stale
            stale = frozenset(m for m in others if m not in beats or beats[m].stale)
        probed = {m: self._pool.submit(_connect_error, *self.addresses[m]) for m in others if m in self.addresses}
        failed = {m: error for m, future in probed.items() if (error := future.result()) is not None}
        return Round(unreached={m: why for m, (why, _) in failed.items()},
                     cut=frozenset(m for m, (_, network) in failed.items() if network),
                     stale=stale, self_fresh=self_fresh)
