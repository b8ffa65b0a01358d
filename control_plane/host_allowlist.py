"""Which ``Host`` the admin API answers: a defence against DNS rebinding (the rule; the check of each
request is ``admin.hosts``'s).

A web page can make a browser resolve its own name to 127.0.0.1 (or to a
control plane inside the victim's network) and then read the answers, as the
browser thinks it talks to the page's origin. The browser still sends that
name in ``Host``: so the admin API answers only a Host it knows, and refuses
any other with 400 ``host_not_allowed`` before the token check, routing or
reading the body.

Known hosts:

- ``localhost`` (and ``localhost.``);
- an IP literal (``127.0.0.1``, ``[::1]``, a pod's IP): a page cannot be
  served from an address's origin by rebinding a name, and Kubernetes probes
  and pod-discovering scrapers address the control plane so;
- the names the operator lists in ``admin_allowed_hosts`` (a Service's DNS
  name, a public name), or ``*`` for any (behind a proxy that checks Host).

With or without a port, any port. A request with no Host at all (HTTP/1.0)
cannot come from a browser and is answered.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

ANY_HOST = "*"
LOOPBACK_NAMES = frozenset({"localhost"})
# A DNS name as an operator would list it: labels of letters, digits, '-' and '_', dot-separated.
_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")


def check_allowed_host(entry: str) -> str:
    """One ``admin_allowed_hosts`` entry, normalised (lower case, no trailing dot); ValueError otherwise."""
    name = entry.strip().lower().rstrip(".")
    if name == ANY_HOST or _NAME.match(name) or _ip_literal(name):
        return name
    raise ValueError(f"admin_allowed_hosts entry {entry!r} is not a host name, an IP address or '*' "
                     "(give the name alone: no scheme, port or path; any port matches)")


def _ip_literal(host: str) -> bool:
    address = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The name of a ``Host`` header value, without its port: ``[::1]:8080`` -> ``[::1]``, ``A.b.:80`` -> ``a.b``."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[:end + 1] if end > 0 else value
    return value.rpartition(":")[0].rstrip(".") if value.count(":") == 1 else value.rstrip(".")


@dataclass(frozen=True)
class AllowedHosts:
    """The admin API's known hosts (module docstring): loopback, IP literals and the configured names."""

    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, configured: Iterable[str]) -> AllowedHosts:
        return cls(frozenset(check_allowed_host(entry) for entry in configured))

    def allows(self, header: str | None) -> bool:
        if header is None:
            return True
        name = host_name(header)
        return (ANY_HOST in self.names or name in LOOPBACK_NAMES or name in self.names or _ip_literal(name))
