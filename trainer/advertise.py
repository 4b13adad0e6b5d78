"""The trainer's side of ``protocol/network.py``: check the address this group advertises and
point gloo at its interface, before any process group exists."""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping


from protocol.lighthouse import lighthouse_endpoint
from protocol.network import (GLOO_INTERFACE_ENV, advertise_problem, interface_of, local_interfaces,
                              reachable_addresses, resolve)
from trainer.config import TrainerConfig
from trainer.errors import ConfigError


def advertised_host(cfg: TrainerConfig) -> str:
    """Where the other groups reach this one: ``--advertise-host``, else this machine's name."""
    return cfg.advertise_host or socket.gethostname()


def use_advertised_interface(cfg: TrainerConfig, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Refuses (ConfigError, one line) an advertised address that is loopback while the Lighthouse
    is not, and makes gloo use the interface that holds it (``GLOO_SOCKET_IFNAME``, unless the
    environment names one already). Returns the interface gloo will use, None for gloo's own choice
    (an address no interface here holds, as behind NAT)."""
    host = advertised_host(cfg)
    try:
        address = resolve(host)
    except OSError as err:
        raise ConfigError(f"--advertise-host {host} does not resolve here ({err}); pass this host's address") from None
    interfaces = local_interfaces()
    try:
        lighthouse_address = resolve(lighthouse_endpoint(cfg.lighthouse)[0])
    except (ValueError, OSError):
        lighthouse_address = None  # the reachability check says what is wrong with it
    if lighthouse_address is not None:
        why = advertise_problem(host, address, cfg.lighthouse, lighthouse_address, reachable_addresses(interfaces))
        if why:
            raise ConfigError(why)
    interface = interface_of(address, interfaces)
    if interface is not None:
        env.setdefault(GLOO_INTERFACE_ENV, interface)
    return env.get(GLOO_INTERFACE_ENV)
