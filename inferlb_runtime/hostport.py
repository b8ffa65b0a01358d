"""Endpoint ids and ``host:port`` authorities, one definition for every service.

An endpoint's id is ``address:port`` with the address as written in EDS
(``10.0.0.1:8000``, ``::1:8000``); the control plane keys its state, stored
overrides and metric labels by it, and ext_proc its fleet view and cost
model. Envoy writes the same endpoint as a URL authority (``[::1]:8000``,
e.g. the ``upstream.address`` attribute it sends ext_proc), and so do URLs.
``endpoint_id`` and ``authority`` turn one into the other, so an IPv6 worker
is the same endpoint on both sides.
"""

from __future__ import annotations

import ipaddress
import os


def endpoint_id(address: str, port: int) -> str:
    """The id of the endpoint at ``address`` (an IP literal, no brackets) and ``port``."""
    return f"{address}:{port}"


def authority(address: str, port: int) -> str:
    """``address:port`` as URLs and Envoy write it: an IPv6 literal in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def id_of_authority(text: str) -> str:
    """The endpoint id of an ``ip:port`` / ``[ipv6]:port`` authority; ``ValueError`` if it is not one.

    The address comes out canonical (``ipaddress``), as discovery and the admin API store it.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not an ip:port authority: {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an unbracketed IPv6 address would make the port ambiguous
        raise ValueError(f"IPv6 address without brackets: {text!r}")
    return endpoint_id(str(ipaddress.ip_address(host)), int(port))


def peer_address(peer: str) -> str | None:
    """The IP literal of a gRPC peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``); None for anything
    else (a unix socket). It is where a client's connection comes from, not what the client claims."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return None
    try:
        return id_of_authority(rest).rpartition(":")[0]
    except ValueError:
        return None


def is_ip(address: str) -> bool:
    """Whether ``address`` is an IP literal (v4 or v6), not a host name."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


# sockaddr_un.sun_path on Linux holds 108 bytes, the terminating NUL included.
MAX_UNIX_SOCKET_PATH_BYTES = 107


def fits_unix_socket(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is short enough to name a Unix domain socket (bind() refuses a longer one)."""
    return len(os.fsencode(path)) <= MAX_UNIX_SOCKET_PATH_BYTES
