"""Render Envoy's bootstrap from ``envoy/bootstrap.yaml``.

The bootstrap only says who this Envoy is and where the control plane is;
everything else comes over ADS. ``string.Template.substitute`` is strict, so
a placeholder without a value is an error here rather than a broken Envoy.

With TLS files (``xds_tls_cert``, ``xds_tls_key``, ``xds_tls_ca``: all three
or none) the xds cluster gets an UpstreamTlsContext (``envoy/bootstrap-xds-tls.yaml``):
mutual TLS to a control plane that runs with ``xds_tls_*`` set. Envoy checks
the control plane's certificate against the CA and against the server name
(``xds_tls_server_name``, by default ``xds_address``) as a DNS or IP subject
alternative name. Without them the rendering is what it always was: plaintext.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from string import Template
from urllib.parse import quote

from inferlb_runtime.hostport import is_ip

DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"
XDS_TLS_TEMPLATE = DEFAULT_TEMPLATE.parent / "bootstrap-xds-tls.yaml"



def envoy_startup_stats_url(admin_url: str) -> str:
    """Envoy's admin counters that say where its start-up stands: connected to the control plane or not,
    CDS and LDS updates received or rejected, clusters and listeners still warming. A diagnosis when it is
    not LIVE in time (its /init_dump does not cover the clusters' initialisation)."""
    pattern = (r"^(control_plane\.|cluster_manager\.(cds\.|warming_clusters|active_clusters)"
               r"|listener_manager\.(lds\.|total_listeners))")
    return f"{admin_url}/stats?filter={quote(pattern)}"

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
    return "STATIC" if is_ip(address) else "STRICT_DNS"  # STRICT_DNS: a host name, e.g. a Compose service


def _absolute(name: str, value: str) -> str:
    if not isinstance(value, str) or not PurePosixPath(value).is_absolute():
        raise ValueError(f"{name} must be an absolute path (Envoy reads it on its own host), got {value!r}")
    return _text(name, value)


def _transport_socket(cert: str | None, key: str | None, ca: str | None, server_name: str) -> str:
    """The xds cluster's mTLS block (its own lines, after the cluster's last), or "" for plaintext."""
    given = {"xds_tls_cert": cert, "xds_tls_key": key, "xds_tls_ca": ca}
    if all(v is None for v in given.values()):
        return ""
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"xds_tls_cert, xds_tls_key and xds_tls_ca go together: {', '.join(missing)} missing")
    block = Template(XDS_TLS_TEMPLATE.read_text()).substitute(
        tls_cert=_absolute("xds_tls_cert", cert),  # type: ignore[arg-type]
        tls_key=_absolute("xds_tls_key", key),  # type: ignore[arg-type]
        tls_ca=_absolute("xds_tls_ca", ca),  # type: ignore[arg-type]
        sni=_text("xds_tls_server_name", server_name) if not is_ip(server_name) else '""',
        san_type="IP_ADDRESS" if is_ip(server_name) else "DNS",
        server_name=_text("xds_tls_server_name", server_name),
    )
    return "\n" + block.rstrip("\n")


def render_bootstrap(
    *,
    node_id: str,
    node_cluster: str = "inferlb",
    xds_address: str = "127.0.0.1",
    xds_port: int = 18000,
    admin_port: int = 9901,
    delta: bool = False,
    xds_tls_cert: str | None = None,
    xds_tls_key: str | None = None,
    xds_tls_ca: str | None = None,
    xds_tls_server_name: str | None = None,
    template: Path | None = None,
) -> str:
    """The bootstrap YAML: ``delta`` picks incremental xDS (DELTA_GRPC) over state-of-the-world;
    the ``xds_tls_*`` files (absolute paths, all three or none) turn on mTLS to the control plane."""
    text = (template or DEFAULT_TEMPLATE).read_text()
    return Template(text).substitute(
        node_id=_text("node_id", node_id),
        node_cluster=_text("node_cluster", node_cluster),
        xds_address=_text("xds_address", xds_address),
        xds_cluster_type=_cluster_type(xds_address),
        xds_port=_port("xds_port", xds_port),
        admin_port=_port("admin_port", admin_port),
        api_type="DELTA_GRPC" if delta else "GRPC",
        xds_transport_socket=_transport_socket(xds_tls_cert, xds_tls_key, xds_tls_ca,
                                               xds_tls_server_name or xds_address),
    )


def generated_header(argv: list[str]) -> str:
    """The comment that marks a committed rendering (deploy/compose/envoy.yaml) and says how to redo it."""
    return (f"# GENERATED by `python -m inferlb.bootstrap {' '.join(argv)}`;\n"
            "# tests/test_compose.py fails if it drifts from render_bootstrap. Do not edit by hand.\n")


def main(argv: list[str] | None = None) -> int:
    """Print a rendered bootstrap, e.g. for Compose: --node-id envoy-compose --xds-address control-plane."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m inferlb.bootstrap",
                                     description="Render Envoy's bootstrap (envoy/bootstrap.yaml) to stdout.")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--node-cluster", default="inferlb")
    parser.add_argument("--xds-address", default="127.0.0.1", help="an IP (STATIC) or a host name (STRICT_DNS)")
    parser.add_argument("--xds-port", type=int, default=18000)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--delta", action="store_true", help="incremental xDS")
    parser.add_argument("--xds-tls-cert", metavar="PATH", help="mTLS to the control plane: Envoy's certificate "
                        "chain (absolute path on Envoy's host; with --xds-tls-key and --xds-tls-ca)")
    parser.add_argument("--xds-tls-key", metavar="PATH", help="mTLS: the private key of --xds-tls-cert")
    parser.add_argument("--xds-tls-ca", metavar="PATH", help="mTLS: the CA that signs the control plane's certificate")
    parser.add_argument("--xds-tls-server-name", metavar="NAME",
                        help="mTLS: the DNS or IP name the control plane's certificate must carry "
                             "(default: --xds-address)")
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    try:
        text = render_bootstrap(node_id=args.node_id, node_cluster=args.node_cluster, xds_address=args.xds_address,
                                xds_port=args.xds_port, admin_port=args.admin_port, delta=args.delta,
                                xds_tls_cert=args.xds_tls_cert, xds_tls_key=args.xds_tls_key,
                                xds_tls_ca=args.xds_tls_ca, xds_tls_server_name=args.xds_tls_server_name)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(generated_header(args_list) + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
