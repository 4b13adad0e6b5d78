"""The address a group advertises to the others, and the interface its collectives use.

A group is reached by the other groups at one address: its manager, its store (torchrun's
master, where the cross-group process group meets) and its heal server. gloo, though, picks the
address of its own sockets from the hostname, and on a stock Debian or Ubuntu host the hostname
resolves to a loopback address (``127.0.1.1 hostname`` in /etc/hosts): across hosts the others
then dial ``127.0.0.1`` and get "Connection refused". So the trainer tells gloo the interface
that holds the advertised address (``GLOO_SOCKET_IFNAME``), and refuses to start when that
address is loopback but the Lighthouse, which every group shares, is not: one of the two is a
mistake, and the job would fail later in a collective with an error that names neither.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence

import psutil

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def resolve(host: str) -> str:
    """The IP address ``host`` resolves to here, IPv4 first (a name with both is dialled at its
    IPv4 by gloo). Raises OSError when it does not resolve."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    ordered = sorted(infos, key=lambda info: info[0] != socket.AF_INET)
    return str(ordered[0][4][0])


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def local_interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their addresses, as :func:`interface_of` takes them."""
    return {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}


def interface_of(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that holds ``address`` in ``interfaces`` (name -> its addresses, as
    ``psutil.net_if_addrs`` lists them), or None: an address no interface here holds."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in interfaces.items():
        for a in addresses:
            try:
                if ipaddress.ip_address(a.split("%", 1)[0]) == wanted:
                    return name
            except ValueError:  # a MAC address: psutil lists the link layer too
                continue
    return None


def reachable_addresses(interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    """This host's IPv4 addresses other hosts could reach: the candidates for --advertise-host."""
    out = []
    for addresses in interfaces.values():
        for a in addresses:
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                continue
            if ip.version == 4 and not ip.is_loopback and not ip.is_link_local:
                out.append(a)
    return out


def advertise_problem(advertised: str, address: str, lighthouse: str, lighthouse_address: str,
                      candidates: Sequence[str]) -> str | None:
    """Why this group must not start with ``advertised`` (resolving to ``address``) while the
    Lighthouse is at ``lighthouse`` (``lighthouse_address``), in one line; None when it may."""
    if not is_loopback(address) or is_loopback(lighthouse_address):
        return None
    hint = f" (this host has {', '.join(candidates)})" if candidates else ""
    return (f"this group would advertise {advertised} ({address}, a loopback address) while the Lighthouse is at "
            f"{lighthouse}: groups on other hosts could not reach its manager, store and collectives; pass "
            f"--advertise-host with this host's address on the network the groups share{hint}")
