"""Render Envoy's bootstrap from ``envoy/bootstrap.yaml``.

The bootstrap only says who this Envoy is and where the control plane is;
everything else comes over ADS. ``string.Template.substitute`` is strict, so
a placeholder without a value is an error here rather than a broken Envoy.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from string import Template

DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"


def _port(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port (1..65535), got {value!r}")
    return value


def _text(name: str, value: str) -> str:
    """A JSON string is a valid YAML scalar: quoting survives any character in ``value``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return json.dumps(value)


def _cluster_type(address: str) -> str:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "STRICT_DNS"  # a host name, e.g. a Compose service
    return "STATIC"


def render_bootstrap(
    *,
    node_id: str,
    node_cluster: str = "inferlb",
    xds_address: str = "127.0.0.1",
    xds_port: int = 18000,
    admin_port: int = 9901,
    delta: bool = False,
    template: Path | None = None,
) -> str:
    """The bootstrap YAML: ``delta`` picks incremental xDS (DELTA_GRPC) over state-of-the-world."""
    text = (template or DEFAULT_TEMPLATE).read_text()
    return Template(text).substitute(
        node_id=_text("node_id", node_id),
        node_cluster=_text("node_cluster", node_cluster),
        xds_address=_text("xds_address", xds_address),
        xds_cluster_type=_cluster_type(xds_address),
        xds_port=_port("xds_port", xds_port),
        admin_port=_port("admin_port", admin_port),
        api_type="DELTA_GRPC" if delta else "GRPC",
    )
