"""The partition drill's fault, made on this group's host: blackhole routes to other hosts.

``ip route replace blackhole ADDR/32`` (``/128`` for IPv6) in this host's network namespace
drops whatever this host sends to ADDR, so connections fail both ways (the peer's SYN arrives,
the answer does not leave) while every other host stays reachable: the cut a broken link
between two racks, or a firewall rule, makes. A drill cuts each side of a pair, or one host from
everything (``job_services``: the Lighthouse's and the control plane's hosts too).

The cut undoes itself after its seconds, by this agent's own timer: an isolated host is out of
the control plane's reach until then. It is undone at once on ``DELETE /cut``, when the agent
stops, and, should the agent die during it, when its successor starts (the routes are kept in
``cut.json`` beside its pid file).

Needs CAP_NET_ADMIN in the host's network namespace (root, or the capability granted to the
agent's container) and iproute2's ``ip``. Refuses a loopback or local address: groups that
share a host cannot be parted by a route, and the cut would take this host's own traffic.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from protocol.agent import CutRequest, CutState
from protocol.files import read_model, write_model
from protocol.lighthouse import lighthouse_endpoint
from protocol.network import interface_of, is_loopback, local_interfaces, resolve
from service.agent.supervisor import StateConflict

log = logging.getLogger("agent.netcut")


class CutRefused(StateConflict):
    """The cut cannot be made here; nothing of it was applied (answered 409, one line)."""


def _prefix(address: str) -> str:
    return f"{address}/{128 if ipaddress.ip_address(address).version == 6 else 32}"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


class RouteCut:
    def __init__(self, group: int, state_path: Path, lighthouse: str, control_plane: str | None):
        self.group = group
        self.state_path = state_path
        self.lighthouse = lighthouse
        self.control_plane = control_plane
        self.state: CutState | None = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @property
    def active(self) -> bool:
        return self.state is not None and self.state.mended_at is None

    def _job_services(self) -> list[str]:
        """The hosts of the Lighthouse and the control plane, as this agent reaches them."""
        try:
            lighthouse = lighthouse_endpoint(self.lighthouse)[0]
        except ValueError as err:
            raise CutRefused(f"{err}; nothing was cut") from None
        control_plane = urlsplit(self.control_plane).hostname if self.control_plane else None
        return [lighthouse, *([control_plane] if control_plane else [])]

    def _addresses(self, hosts: Iterable[str]) -> list[str]:
        """Each host's address; refused when one is loopback or this host's own."""
        out: list[str] = []
        local = local_interfaces()
        for host in hosts:
            try:
                address = resolve(host)
            except OSError as err:
                raise CutRefused(f"group {self.group}'s host cannot resolve {host} ({err}); nothing was cut") from None
            if is_loopback(address) or interface_of(address, local) is not None:
                raise CutRefused(f"{host} ({address}) is group {self.group}'s own host: groups that share a host "
                                 f"cannot be parted by a route; the partition drill needs each group, the Lighthouse "
                                 f"and the control plane on hosts (or network namespaces) of their own")
            if address not in out:
                out.append(address)
        return out

    def apply(self, request: CutRequest) -> CutState:
        """Add every route, or none: one that fails takes back the ones added before it."""
        if shutil.which("ip") is None:
            raise CutRefused(f"group {self.group}'s host has no iproute2 `ip`: install it to run the partition drill")
        with self._lock:
            if self.active:
                raise CutRefused(f"group {self.group}'s host is cut already (from {', '.join(self.state.addresses)} "
                                 f"until {time.strftime('%H:%M:%S', time.localtime(self.state.until))}); "
                                 "mend it first (DELETE /cut)")
            addresses = self._addresses([*request.hosts, *(self._job_services() if request.job_services else [])])
            if not addresses:
                raise CutRefused("no host to cut: name at least one")
            added: list[str] = []
            for address in addresses:
                result = _ip("route", "replace", "blackhole", _prefix(address))
                if result.returncode != 0:
                    self._remove(added)
                    why = result.stderr.strip().removeprefix("RTNETLINK answers: ")
                    raise CutRefused(f"group {self.group}'s agent cannot change its host's routes ({why}): the "
                                     "partition drill needs CAP_NET_ADMIN for the agents (root, or the capability "
                                     "granted to their containers); nothing was cut")
                added.append(address)
            at = time.time()
            self.state = CutState(addresses=addresses, at=at, until=at + request.seconds)
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            write_model(self.state_path, self.state)
            self._timer = threading.Timer(request.seconds, self.mend)
            self._timer.daemon = True
            self._timer.start()
        log.warning("group %d's host cut off from %s for %.1f s", self.group, ", ".join(addresses), request.seconds)
        return self.state

    def mend(self) -> CutState | None:
        """Remove the routes now (the timer's end, ``DELETE /cut``, the agent's stop); the last cut."""
        with self._lock:
            if not self.active:
                return self.state
            if self._timer is not None and self._timer is not threading.current_thread():
                self._timer.cancel()
            self._remove(self.state.addresses)
            self.state = self.state.model_copy(update={"mended_at": time.time()})
            self.state_path.unlink(missing_ok=True)
        log.warning("group %d's host reaches %s again", self.group, ", ".join(self.state.addresses))
        return self.state

    def undo_predecessors(self) -> None:
        """Routes a dead predecessor's cut left in place are removed at start."""
        left = read_model(self.state_path, CutState)
        if left is not None:
            self._remove(left.addresses)
            self.state_path.unlink(missing_ok=True)
            log.warning("removed a previous agent's cut of group %d's host from %s", self.group,
                        ", ".join(left.addresses))

    def _remove(self, addresses: Iterable[str]) -> None:
        for address in addresses:
            result = _ip("route", "del", "blackhole", _prefix(address))
            if result.returncode != 0 and "No such process" not in result.stderr:
                log.error("could not remove the blackhole route to %s: %s", address, result.stderr.strip())
