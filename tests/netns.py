"""Hosts on one machine for the multi-host tests: a network namespace each, on a private bridge.

Each host is a namespace with ``lo`` and an ``eth0`` at ``10.77.0.N/24``; every ``eth0`` is one
end of a veth pair whose other end sits on a bridge in a namespace of its own, so nothing of the
machine's own network changes and no address outside these namespaces is used. A process runs on
a host under ``ip netns exec``. ``isolate`` cuts a host off from all others (its bridge port goes
down; ``reconnect`` brings it back), ``cut`` drops the traffic between two hosts only (a
blackhole route on each side; ``mend`` takes it away). Leaving the context deletes every
namespace; the processes in them must be ended first (the tests' owners end them by tag).

Creating namespaces needs root (CAP_NET_ADMIN) and iproute2: ``skip_unless_available`` skips a
test with the reason where they cannot be made.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess

import pytest

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def why_unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"ftprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as err:
        return f"cannot create a network namespace ({err}); the multi-host tests need root"
    _ip("netns", "del", probe)
    return None


def skip_unless_available() -> None:
    why = why_unavailable()
    if why:
        pytest.skip(why)


class NamespaceHosts:
    """``count`` hosts: ``address(i)`` is host i's, ``run(i)`` the prefix that runs a command there."""

    def __init__(self, count: int):
        self.tag = secrets.token_hex(2)
        self.count = count
        self.switch = f"ft{self.tag}sw"
        self.names = [f"ft{self.tag}h{i}" for i in range(count)]
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def run(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def _port(self, i: int) -> str:
        return f"p{self.tag}{i}"

    def __enter__(self) -> "NamespaceHosts":
        try:
            for name in (self.switch, *self.names):
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", self._port(i),
                    "netns", self.switch)
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", self._port(i), "master", "br0")
                _ip("-n", self.switch, "link", "set", self._port(i), "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    def isolate(self, i: int) -> None:
        """Host i reaches no other host, and none reaches it (its cable pulled)."""
        _ip("-n", self.switch, "link", "set", self._port(i), "down")

    def reconnect(self, i: int) -> None:
        """Host i's cable back in: :meth:`isolate` undone."""
        _ip("-n", self.switch, "link", "set", self._port(i), "up")

    def shape(self, i: int, mbit: float) -> None:
        """Host i sends at most ``mbit`` Mbit/s (a token bucket on its ``eth0``: what leaves it
        queues, as on a slow link; this kernel's ``netem`` adds no delay in a namespace)."""
        subprocess.run([*self.run(i), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                        f"{mbit:g}mbit", "burst", "1mb", "latency", "400ms"], check=True, capture_output=True)

    def sent_bytes(self, i: int) -> int:
        """What host i's ``eth0`` has sent so far."""
        shown = subprocess.run(["ip", "-n", self.names[i], "-s", "-j", "link", "show", "eth0"], check=True,
                               capture_output=True, text=True).stdout
        return json.loads(shown)[0]["stats64"]["tx"]["bytes"]

    def cut(self, i: int, j: int) -> None:
        """Hosts i and j no longer reach each other; both still reach every other host."""
        _ip("-n", self.names[i], "route", "add", "blackhole", f"{self.address(j)}/32")
        _ip("-n", self.names[j], "route", "add", "blackhole", f"{self.address(i)}/32")

    def mend(self, i: int, j: int) -> None:
        """Hosts i and j reach each other again: :meth:`cut` undone."""
        _ip("-n", self.names[i], "route", "del", "blackhole", f"{self.address(j)}/32")
        _ip("-n", self.names[j], "route", "del", "blackhole", f"{self.address(i)}/32")
