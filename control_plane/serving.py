"""How the control plane's two servers listen: the TLS material, loaded and checked before anything
starts, the ADS server's settings, and the admin API's uvicorn TLS arguments.

The config has already refused what must never run (half a TLS set; plaintext beyond loopback without
``xds_allow_plaintext``/``admin_allow_plaintext``, see ``config.py``). Here the files are read: one that
is unreadable, or a key that does not match its certificate, raises :class:`TlsConfigError` naming the
setting and the path, and ``python -m control_plane`` exits 2 before it listens anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from inferlb_runtime.tls import TlsConfigError, check_identity, load_pem_files

from .auth import is_loopback
from .config import ControlPlaneConfig
from .xds.server import XdsServerSettings

__all__ = ["TlsConfigError", "admin_tls_arguments", "warn_plaintext", "xds_server_settings"]


def xds_server_settings(config: ControlPlaneConfig) -> XdsServerSettings:
    """The ADS server's settings; reads and checks the mTLS files when they are configured."""
    tls = None
    if config.xds_tls_cert is not None and config.xds_tls_key is not None and config.xds_tls_client_ca is not None:
        tls = load_pem_files(config.xds_tls_cert, config.xds_tls_key, config.xds_tls_client_ca,
                             settings=("xds_tls_cert", "xds_tls_key", "xds_tls_client_ca"))
    limits = config.xds_limits
    return XdsServerSettings(
        allowed_node_clusters=config.allowed_node_clusters,
        tls=tls,
        keepalive_time_s=limits.keepalive_time_s,
        keepalive_timeout_s=limits.keepalive_timeout_s,
        max_connections=limits.max_connections,
        max_concurrent_streams=limits.max_concurrent_streams,
        max_streams=limits.max_streams,
        max_streams_per_node=limits.max_streams_per_node,
        max_request_bytes=limits.max_request_bytes,
        inbound_buffer=limits.inbound_buffer,
    )


def admin_tls_arguments(config: ControlPlaneConfig) -> dict[str, Any]:
    """uvicorn's ``ssl_certfile``/``ssl_keyfile`` for HTTPS on the admin API (checked first), or nothing."""
    if config.admin_tls_cert is None or config.admin_tls_key is None:
        return {}
    check_identity(config.admin_tls_cert, config.admin_tls_key,
                   cert_setting="admin_tls_cert", key_setting="admin_tls_key")
    return {"ssl_certfile": str(config.admin_tls_cert), "ssl_keyfile": str(config.admin_tls_key)}


def warn_plaintext(config: ControlPlaneConfig, log: logging.Logger) -> None:
    """Plaintext beyond loopback that the operator accepted explicitly: said once, loudly, at start."""
    if config.xds_tls_cert is None and not is_loopback(config.xds_address):
        log.warning("xDS is plaintext beyond loopback (xds_allow_plaintext): anyone who reaches "
                    f"{config.xds_address}:{config.xds_port} and names an allowed node cluster gets the "
                    "fleet's configuration; configure xds_tls_cert/xds_tls_key/xds_tls_client_ca for mTLS",
                    extra={"xds_address": config.xds_address})
    if config.admin_tls_cert is None and not is_loopback(config.admin_address):
        log.warning("the admin API is plaintext beyond loopback (admin_allow_plaintext): its bearer token "
                    "crosses the network in clear; configure admin_tls_cert/admin_tls_key for HTTPS",
                    extra={"admin_address": config.admin_address})
