"""Which other groups' hosts this group's host reaches: a TCP connection to each one's agent.

The agent runs on its group's host, beside the ranks, so a connection it opens to another
group's agent goes the way the groups' collectives go between those hosts. The control plane
asks for it when the groups stall or a commit fails (``service/controlplane/partition.py``). A refused connection
reached the host (its answer came back); a route that drops the traffic, or a cable out, shows
as no answer within the timeout, or as an unreachable network at once.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from protocol.agent import ProbeRequest, ProbeResult


async def _opens(url: str, timeout_s: float) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


async def probe(group: int, request: ProbeRequest) -> ProbeResult:
    """Every peer at once; a peer that neither accepts nor refuses within the timeout is not reached."""
    peers = sorted(request.peers.items())
    opened = await asyncio.gather(*(_opens(str(url), request.timeout_s) for _, url in peers))
    return ProbeResult(group=group, reached={g: ok for (g, _), ok in zip(peers, opened)})
