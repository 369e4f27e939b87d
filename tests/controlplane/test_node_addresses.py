"""The address check before the control plane sends a node anything (pure: a fake resolver):
what the operator's STRATA_NODE_ADDRESSES admits, what must resolve to where the heartbeat came
from, what a local socket allows, and the malformed addresses refused by name."""

from __future__ import annotations

import ipaddress
import re

import pytest

from controlplane.runtime.node_addresses import (
    AddressRefused,
    AllowList,
    address_split,
    allow_list_parse,
    node_target,
)

DNS = {
    "node-0.strata-node.default.svc": ["10.4.0.7"],
    "node-1.example.net": ["203.0.113.9", "2001:db8::9"],
    "localhost": ["::1", "127.0.0.1"],
}


def resolver(host: str, port: int) -> list:
    if host not in DNS:
        raise OSError("Name or service not known")
    return [ipaddress.ip_address(a) for a in DNS[host]]


def target(address: str, seen_from: str | None, allowed: str = "") -> tuple[str, int, str]:
    found = node_target(address, seen_from=seen_from, allowed=allow_list_parse(allowed), resolver=resolver)
    return found.connect, found.port, found.host_header


def test_a_name_that_resolves_to_where_the_heartbeat_came_from_is_pinned_to_that_address():
    assert target("node-0.strata-node.default.svc:9100", "10.4.0.7") == (
        "10.4.0.7",
        9100,
        "node-0.strata-node.default.svc:9100",
    )
    assert target("10.4.0.7:9100", "::ffff:10.4.0.7") == ("10.4.0.7", 9100, "10.4.0.7:9100")
    assert target("node-1.example.net:9100", "2001:db8::9")[0] == "2001:db8::9"
    found = node_target("[2001:db8::9]:9100", seen_from="2001:db8::9", allowed=AllowList(), resolver=resolver)
    assert found.base_url == "http://[2001:db8::9]:9100"


def test_another_address_is_refused_naming_both():
    with pytest.raises(
        AddressRefused, match=r"'10.9.9.9:9100' \(10.9.9.9\) is not where the node is: its heartbeat came from 10.4.0.7"
    ):
        target("10.9.9.9:9100", "10.4.0.7")
    with pytest.raises(AddressRefused, match="its heartbeat came from 10.4.0.7"):
        target("node-1.example.net:9100", "10.4.0.7")
    with pytest.raises(AddressRefused, match="does not resolve"):
        target("nowhere.invalid:9100", "10.4.0.7")


def test_over_a_local_socket_only_loopback_is_accepted():
    assert target("127.0.0.1:9100", None)[0] == "127.0.0.1"
    assert target("localhost:9100", None)[0] == "::1"
    with pytest.raises(AddressRefused, match="came over a local socket, so only a loopback address"):
        target("10.4.0.7:9100", None)
    with pytest.raises(AddressRefused, match="only a loopback address"):
        target("0.0.0.0:9100", None)


def test_the_operators_list_admits_names_suffixes_and_networks():
    allowed = "node-1.example.net, *.svc, 10.0.0.0/8, 192.0.2.5"
    assert target("node-1.example.net:9100", None, allowed)[0] == "node-1.example.net"  # named: not resolved
    assert target("NODE-9.other.SVC:9100", "10.4.0.7", allowed)[0] == "NODE-9.other.SVC"
    assert target("10.9.9.9:9100", "10.4.0.7", allowed)[0] == "10.9.9.9"
    assert target("192.0.2.5:9100", None, allowed)[0] == "192.0.2.5"
    with pytest.raises(AddressRefused):
        target("192.0.2.6:9100", None, allowed)
    with pytest.raises(AddressRefused):
        target("evilsvc:9100", None, allowed)  # '*.svc' needs the dot


@pytest.mark.parametrize(
    "address",
    [
        "",
        "http://node:9100",
        "node:9100/admin",
        "user@node:9100",
        "node",
        "node:",
        "node:0",
        "node:65536",
        "node:9100?x=1",
        "node:9100#x",
        "no de:9100",
        "::1:9100",
        "[node]:9100",
        "[::1]9100",
        "fe80::1%eth0:9100",
    ],
)
def test_malformed_addresses_are_refused_by_name(address):
    with pytest.raises(AddressRefused, match=re.escape(f"address {address!r}")):
        address_split(address)


@pytest.mark.parametrize("entry", ["*.", "bad host", "10.0.0.0/33", "node/8", "*.-x", "node:9100"])
def test_a_bad_allow_list_entry_is_named(entry):
    with pytest.raises(ValueError, match=re.escape(f"STRATA_NODE_ADDRESSES: {entry!r}")):
        allow_list_parse(f"ok.example, {entry}")
