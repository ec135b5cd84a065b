"""The address this process advertises to its peers: one answer for every component.

Connectors put it in their handles (consumers dial it to pull an array) and the LLM stage
gives it to vLLM for its core's sockets. In a pod it is the pod IP: kubelet writes the pod's
hostname into /etc/hosts with that address. On a laptop or a VM whose hostname resolves only
to loopback (Debian maps it to 127.0.1.1), the interface of the default route is what other
machines reach; with no route at all, loopback is all there is.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Sequence


@functools.cache
def advertised_host() -> str:
    """This machine's address as other machines reach it (see the module's docstring)."""
    return choose_advertised_host(_hostname_addresses(), _default_route_address())


def choose_advertised_host(hostname_addresses: Sequence[str], default_route: str | None) -> str:
    """The first non-loopback address of the hostname, else the default route's, else
    loopback."""
    for address in hostname_addresses:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    if default_route is not None and not ipaddress.ip_address(default_route).is_unspecified:
        return default_route
    return "127.0.0.1"


def address_host(address: str) -> str:
    """The host part of a ``host:port`` address (``[v6]:port`` too); "" for none."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return address.strip("[]")
    return host.strip("[]")


def _hostname_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def _default_route_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            # connect() on UDP sends nothing; it only makes the kernel pick the route.
            probe.connect(("10.255.255.255", 1))
            return str(probe.getsockname()[0])
    except OSError:
        return None
