"""omni_runtime.net: the one answer to "where do my peers reach me"."""

from __future__ import annotations

import ipaddress

import pytest

from omni_runtime.connectors.tcp import TCPConnector
from omni_runtime.net import address_host, advertised_host, choose_advertised_host


def test_the_hostname_address_wins_when_it_is_not_loopback() -> None:
    assert choose_advertised_host(["127.0.1.1", "10.1.2.3"], "192.168.0.5") == "10.1.2.3"


def test_a_loopback_hostname_falls_back_to_the_default_route() -> None:
    # Debian maps the hostname to 127.0.1.1: peers on other machines cannot dial that.
    assert choose_advertised_host(["127.0.1.1"], "192.168.0.5") == "192.168.0.5"
    assert choose_advertised_host([], "192.168.0.5") == "192.168.0.5"


def test_without_either_it_is_loopback() -> None:
    assert choose_advertised_host([], None) == "127.0.0.1"
    assert choose_advertised_host(["127.0.1.1"], "0.0.0.0") == "127.0.0.1"


def test_this_machine_gets_a_dialable_address_and_connectors_use_it() -> None:
    assert not ipaddress.ip_address(advertised_host()).is_unspecified
    connector = TCPConnector("tcp", {})
    try:
        assert connector.advertise_host == advertised_host()
    finally:
        connector.close()


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.0.0.1:52000", "10.0.0.1"),
        ("[fd00::1]:52000", "fd00::1"),
        ("localhost:8000", "localhost"),
        ("10.0.0.1", "10.0.0.1"),
        ("", ""),
    ],
)
def test_the_host_of_an_address(address: str, host: str) -> None:
    assert address_host(address) == host
