"""A JSON view of the Lighthouse, parsed from the HTML fragment torchft 0.2.0 serves at /status.

torchft has no JSON endpoint. This parser fills ``protocol.lighthouse.LighthouseStatus``; it is
pinned to torchft 0.2.0's template and checked against the real Lighthouse by
tests/e2e/test_lighthouse.py (with 0, 1 and 2 members): a torchft upgrade that
changes the page fails there (and :class:`StatusFormatError` here) instead of silently
returning an empty quorum. Its readers: the Lighthouse wrapper (``lighthouse/app.py``) and a
healing rank looking for every live peer (``trainer/heal_peers.py``).
"""

from __future__ import annotations

import html
import re
import urllib.request

from protocol.lighthouse import Heartbeat, LighthouseStatus, NextQuorum, QuorumMember
from protocol.replicas import group_of


class StatusFormatError(ValueError):
    """The /status page no longer has the shape this parser was written for."""


def _required(pattern: str, text: str, what: str) -> re.Match:
    match = re.search(pattern, text, re.S)
    if match is None:
        raise StatusFormatError(f"Lighthouse /status has no {what}: the page format changed (parser pinned to torchft 0.2.0)")
    return match


_MEMBER = re.compile(
    r'<div class="member\s*(?P<recovering>recovering)?\s*">\s*<b>(?P<id>[^<]+)</b>\s*<br/>\s*'
    r"Step:\s*(?P<step>-?\d+)\s*<br/>\s*Manager:\s*(?P<manager>\S+)\s*<br/>\s*"
    r"TCPStore:\s*(?P<store>\S*)\s*<br/>\s*World size:\s*(?P<world>\d+)",
    re.S,
)
_HEARTBEAT = re.compile(
    r'<li class="heartbeat\s*(?P<old>old)?\s*">\s*(?P<id>[^<]+?):\s*seen\s*(?P<age>[\d.]+)s ago\s*</li>', re.S
)
_NEXT_COUNTS = re.compile(r"\[(\d+)/(\d+) participants healthy\]\[(\d+) heartbeating\]")


def fetch_status(url: str, timeout_s: float) -> LighthouseStatus:
    """The Lighthouse's status page at ``url`` (``protocol.lighthouse.status_url``), read and parsed.
    Raises OSError when it does not answer and :class:`StatusFormatError` when its page changed."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_status(response.read().decode())


def parse_status(page: str) -> LighthouseStatus:
    quorum_id = int(_required(r"Current quorum_id:\s*(-?\d+)", page, "current quorum id").group(1))
    next_text = html.unescape(_required(r"Next quorum status:\s*([^\n<]*)", page, "next quorum status").group(1).strip())
    _required(r"<h3>Previous Quorum</h3>", page, "previous-quorum section")
    heartbeats_at = _required(r"<h2>Heartbeats</h2>", page, "heartbeats section").start()
    previous, heartbeat_part = page[:heartbeats_at], page[heartbeats_at:]

    counts = _NEXT_COUNTS.search(next_text)
    next_quorum = NextQuorum(text=next_text)
    if counts:
        next_quorum = NextQuorum(text=next_text, healthy_participants=int(counts.group(1)),
                                 participants=int(counts.group(2)), heartbeating=int(counts.group(3)))

    prev_id = re.search(r"Previous quorum id:\s*(-?\d+)", previous)
    age = re.search(r"Quorum age:\s*([\d.]+)s", previous)
    members = [
        QuorumMember(
            replica_id=html.unescape(m["id"]).strip(), group=group_of(html.unescape(m["id"]).strip()),
            step=int(m["step"]), manager_address=m["manager"], store_address=m["store"],
            world_size=int(m["world"]), recovering=bool(m["recovering"]),
        )
        for m in _MEMBER.finditer(previous)
    ]
    if prev_id:
        expected = int(_required(r"Num participants:\s*(\d+)", previous, "participant count").group(1))
        if expected != len(members):
            raise StatusFormatError(f"Lighthouse /status lists {expected} participants but {len(members)} parsed: the member format changed")
    heartbeats = [
        Heartbeat(replica_id=html.unescape(h["id"]).strip(), group=group_of(html.unescape(h["id"]).strip()),
                  age_s=float(h["age"]), stale=bool(h["old"]))
        for h in _HEARTBEAT.finditer(heartbeat_part)
    ]
    if heartbeat_part.count('class="heartbeat') != len(heartbeats):
        raise StatusFormatError("Lighthouse /status heartbeat entries changed format")
    return LighthouseStatus(
        quorum_id=quorum_id, next_quorum=next_quorum,
        previous_quorum_id=int(prev_id.group(1)) if prev_id else None,
        quorum_age_s=float(age.group(1)) if age else None, members=members, heartbeats=heartbeats,
    )
