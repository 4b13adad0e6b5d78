"""The address a group advertises and the interface gloo uses (protocol/network.py,
trainer/advertise.py), decided on recorded interface tables: what ``psutil.net_if_addrs`` lists
on a network-namespace host, on a stock Debian host, and on this machine."""

from __future__ import annotations

import pytest

from protocol.lighthouse import lighthouse_endpoint
from protocol.network import GLOO_INTERFACE_ENV, advertise_problem, interface_of, reachable_addresses
from trainer.advertise import use_advertised_interface
from trainer.config import TrainerConfig
from trainer.errors import ConfigError

NAMESPACE_HOST = {"lo": ["127.0.0.1", "::1", "00:00:00:00:00:00"],
                  "eth0": ["10.77.0.5", "fe80::8c3a:1ff:fe2b:3c4d%eth0", "8e:3a:01:2b:3c:4d"]}
DEBIAN_HOST = {"lo": ["127.0.0.1", "::1"], "enp1s0": ["192.168.1.20", "fe80::1%enp1s0"],
               "docker0": ["172.17.0.1"], "tailscale0": ["100.64.0.7", "169.254.3.3"]}


def test_the_interface_that_holds_an_address():
    assert interface_of("10.77.0.5", NAMESPACE_HOST) == "eth0"
    assert interface_of("127.0.1.1", NAMESPACE_HOST) is None, "an address no interface holds: gloo's own choice"
    assert interface_of("127.0.0.1", DEBIAN_HOST) == "lo"
    assert interface_of("fe80::1", DEBIAN_HOST) == "enp1s0"
    assert interface_of("100.64.0.7", DEBIAN_HOST) == "tailscale0"


def test_the_addresses_other_hosts_could_reach():
    assert reachable_addresses(NAMESPACE_HOST) == ["10.77.0.5"]
    assert reachable_addresses(DEBIAN_HOST) == ["192.168.1.20", "172.17.0.1", "100.64.0.7"]


def test_a_loopback_advertisement_is_refused_only_when_the_lighthouse_is_elsewhere():
    why = advertise_problem("node7", "127.0.1.1", "http://10.77.0.1:29510", "10.77.0.1", ["10.77.0.5"])
    assert why == ("this group would advertise node7 (127.0.1.1, a loopback address) while the Lighthouse is at "
                   "http://10.77.0.1:29510: groups on other hosts could not reach its manager, store and "
                   "collectives; pass --advertise-host with this host's address on the network the groups share "
                   "(this host has 10.77.0.5)")
    assert advertise_problem("node7", "127.0.1.1", "http://127.0.0.1:29510", "127.0.0.1", ["10.77.0.5"]) is None
    assert advertise_problem("10.77.0.5", "10.77.0.5", "http://10.77.0.1:29510", "10.77.0.1", []) is None
    assert advertise_problem("::1", "::1", "http://[fd00::1]:29510", "fd00::1", []) is not None


def test_the_lighthouse_host_of_each_way_to_write_its_address():
    assert lighthouse_endpoint("http://10.77.0.1:29510")[0] == "10.77.0.1"
    assert lighthouse_endpoint("lighthouse:29510")[0] == "lighthouse"
    assert lighthouse_endpoint("http://[fd00::1]:29510")[0] == "fd00::1"
    with pytest.raises(ValueError):
        lighthouse_endpoint("http://:29510")


def test_the_trainer_points_gloo_at_the_advertised_interface_unless_told_otherwise():
    cfg = TrainerConfig(advertise_host="127.0.0.1", lighthouse="http://127.0.0.1:29510")
    env: dict[str, str] = {}
    assert use_advertised_interface(cfg, env) == "lo" and env == {GLOO_INTERFACE_ENV: "lo"}
    chosen = {GLOO_INTERFACE_ENV: "eth1"}
    assert use_advertised_interface(cfg, chosen) == "eth1", "a GLOO_SOCKET_IFNAME the user set is kept"


def test_the_trainer_refuses_a_loopback_advertisement_to_a_lighthouse_on_another_host():
    cfg = TrainerConfig(advertise_host="127.0.0.1", lighthouse="http://10.77.0.1:29510")
    env: dict[str, str] = {}
    with pytest.raises(ConfigError, match="a loopback address"):
        use_advertised_interface(cfg, env)
    assert env == {}, "nothing is half applied"
