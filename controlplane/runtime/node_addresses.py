"""Where the control plane may send a request for a node: the check between a node's reported
address and the network.

A node reports its own address in its heartbeat, and the control plane sends that node's admin
key there. A node that reported someone else's address would receive requests (and keys) meant
for another host, so before anything is sent the reported host must be one of:

- named by the operator's allow-list `STRATA_NODE_ADDRESSES`: comma-separated entries, each a
  host name (`node-0.example.net`, matched exactly, case-insensitively), a name suffix
  (`*.svc`: any name ending in `.svc`), an IP address or a network in CIDR form
  (`10.0.0.0/8`, matched against what the host resolves to);
- a name or address that resolves to the address the node's heartbeat came from (`seen_from`,
  recorded by the database, not by the node);
- a loopback address, when the heartbeat came over a local socket (`seen_from` empty).

Whenever the check resolved the host, the request goes to the address it checked (with the
reported name in the Host header), so a second DNS answer cannot move it elsewhere. Pure Python,
no Django: the settings parse the allow-list at start-up with `allow_list_parse`."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
SETTING = "STRATA_NODE_ADDRESSES"


class AddressRefused(Exception):
    """The control plane sends nothing to this address; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class AllowList:
    """The operator's node addresses: exact host names, name suffixes, networks."""

    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def admits_name(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.names or any(host.endswith(suffix) for suffix in self.suffixes)

    def network_of(self, addresses: list[IPAddress]) -> IPAddress | None:
        """The first of `addresses` inside an allowed network, else None."""
        return next((a for a in addresses if any(a in net for net in self.networks if a.version == net.version)), None)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where to connect for a node (`connect` host, `port`) and the Host header to send."""

    connect: str
    port: int
    host_header: str

    @property
    def base_url(self) -> str:
        host = f"[{self.connect}]" if ":" in self.connect else self.connect
        return f"http://{host}:{self.port}"


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")


def _check_name(entry: str, name: str) -> str:
    name = name.lower().rstrip(".")
    if not name or not set(name) <= _NAME_CHARS or name.startswith((".", "-")):
        raise ValueError(f"{SETTING}: {entry!r} is not a host name, a '*.suffix', an address or a network")
    return name


def allow_list_parse(text: str) -> AllowList:
    """`STRATA_NODE_ADDRESSES` as an AllowList; ValueError naming the bad entry."""
    names: set[str] = set()
    suffixes: list[str] = []
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry.startswith("*."):
            suffixes.append("." + _check_name(entry, entry[2:]))
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if "/" in entry:
            raise ValueError(f"{SETTING}: {entry!r} is not a network (expected an address/prefix length)")
        names.add(_check_name(entry, entry))
    return AllowList(frozenset(names), tuple(suffixes), tuple(networks))


def address_split(address: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[addr]:port`) split; AddressRefused for anything else: a scheme, a
    path, user information, a query, spaces, a missing or out-of-range port."""
    if not address or any(c in address for c in "/@?#\\%") or any(c.isspace() for c in address):
        raise AddressRefused(f"address {address!r} is not host:port (no scheme, path, '@' or query)")
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise AddressRefused(f"address {address!r} is not host:port")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressRefused(f"address {address!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not host or ":" in host:
            raise AddressRefused(f"address {address!r} is not host:port")
        if not set(host.lower()) <= _NAME_CHARS:
            raise AddressRefused(f"address {address!r}: {host!r} is not a host name or address")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressRefused(f"address {address!r}: the port must be 1-65535")
    return host, int(port_text)


def _ip(text: str) -> IPAddress:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses `host` resolves to, in the resolver's order, without repeats."""
    found: list[IPAddress] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = _ip(str(sockaddr[0]))
        if address not in found:
            found.append(address)
    return found


def node_target(
    address: str,
    *,
    seen_from: str | None,
    allowed: AllowList,
    resolver: Callable[[str, int], list[IPAddress]] = resolve,
) -> Target:
    """Where a request for the node that reported `address` may go (module docstring), or
    AddressRefused naming the address and where the node's heartbeat came from."""
    host, port = address_split(address)
    if allowed.admits_name(host):
        return Target(host, port, address)
    try:
        addresses = [_ip(host)]
    except ValueError:
        try:
            addresses = resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise AddressRefused(f"address {address!r}: {host!r} does not resolve ({exc})") from exc
    if (inside := allowed.network_of(addresses)) is not None:
        return Target(str(inside), port, address)
    if seen_from:
        origin = _ip(seen_from)
        if origin in addresses:
            return Target(str(origin), port, address)
        came = f"its heartbeat came from {origin}"
    else:
        if (local := next((a for a in addresses if a.is_loopback), None)) is not None:
            return Target(str(local), port, address)
        came = "its heartbeat came over a local socket, so only a loopback address is accepted"
    raise AddressRefused(
        f"address {address!r} ({', '.join(map(str, addresses)) or 'no address'}) is not where the node is: "
        f"{came}, and {SETTING} does not name it; nothing was sent there"
    )
