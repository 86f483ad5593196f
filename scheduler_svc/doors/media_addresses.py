"""Which hosts and addresses an image URL may reach (media_urls.py): the allow-list of domains and the refusal of
every address that is not public, IPv4 addresses embedded in IPv6 ones included (docs/SECURITY.md, "Image URLs")."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence

import httpx

from scheduler_svc.media_domains import normalize_domain

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598): not global, but not "private" either
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are an IPv4 address


def host_of(url: httpx.URL) -> str:
    """The URL's host as allow-list entries are written: IDNA (xn--) form, lower case, no trailing dot."""
    return normalize_domain(url.raw_host.decode("ascii")) if url.raw_host else ""


def domain_allowed(host: str, domains: Sequence[str]) -> bool:
    """Whether ``host`` (as ``host_of`` gives it) is an entry of ``domains`` or a subdomain of a ``*.`` entry.

    ``*.example.com`` matches ``a.example.com`` and ``a.b.example.com``, not ``example.com`` itself (list both for
    both), and never an IP address (``*.0.0.1`` does not match ``127.0.0.1``)."""
    if host in domains:
        return True
    return not is_ip_literal(host) and any(d.startswith("*.") and host.endswith(d[1:]) for d in domains)


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries to (IPv4-mapped, 6to4, NAT64), which is where it would connect."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _non_public(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public unicast address (as words for an error), or None when it is one."""
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:  # 169.254.0.0/16 holds the cloud metadata service 169.254.169.254
        return "link-local"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "shared (CGNAT)"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if ip.is_reserved:  # before private: Python counts 240.0.0.0/4 as both
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "non-global"
    return None


def address_refusal(ip: IPAddress, allowed_networks: Sequence[IPNetwork] = ()) -> str | None:
    """Why a fetch may not connect to ``ip`` (words for an error), or None when it may: a public unicast address,
    or one inside ``allowed_networks``. An IPv6 address that carries an IPv4 one (IPv4-mapped, 6to4, NAT64) is
    judged by the IPv4 one, where the packets end up: NAT64 of a public address passes (IPv6-only clusters reach
    the IPv4 internet so), NAT64 of 10.0.0.1 does not."""
    inner = _embedded_ipv4(ip)
    candidates: list[IPAddress] = [ip] if inner is None else [ip, inner]
    if any(c.version == n.version and c in n for c in candidates for n in allowed_networks):
        return None
    if inner is None:
        return _non_public(ip)
    reason = _non_public(inner)
    return None if reason is None else f"{reason} (inside the IPv6 address {ip})"


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as getaddrinfo (the system resolver) answers, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def parse_address(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])  # a scope id (fe80::1%eth0) is not part of the address
