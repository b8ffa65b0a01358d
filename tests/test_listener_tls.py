"""Optional TLS on Envoy's listener, through real Envoy 1.40: with ``data_plane.listener_tls_cert`` and
``listener_tls_key`` set, the control plane's LDS puts a DownstreamTlsContext on the listener and
clients speak HTTPS to it (a throwaway CA from trustme); plaintext is refused there. Off by default
(every other Envoy test runs plaintext).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
import trustme

from .stack import running_control_plane, running_envoy, running_sim_workers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def https_post(url: str, context: ssl.SSLContext) -> httpx.Response:
    with httpx.Client(verify=context, timeout=30, trust_env=False) as client:
        return client.post(url, json={"input": "over TLS"})


def test_the_listener_serves_https_with_the_configured_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    certificate = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = tmp_path / "listener-cert.pem", tmp_path / "listener-key.pem"
    certificate.private_key_pem.write_to_path(str(key_path))
    with open(cert_path, "wb") as chain:  # the leaf first, then the rest of the chain
        for blob in certificate.cert_chain_pems:
            chain.write(blob.bytes())
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)

    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[worker.id], env={
                "INFERLB_CP_DATA_PLANE__LISTENER_TLS_CERT": str(cert_path),
                "INFERLB_CP_DATA_PLANE__LISTENER_TLS_KEY": str(key_path)}) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-tls") as envoy:
        procs = [cp.proc, envoy.proc, worker.proc]
        url = f"https://127.0.0.1:{cp.listener_port}/v1/embeddings"
        wait_for(lambda: envoy.healthy_hosts() == {worker.id}, 30, "Envoy to see the worker healthy", procs)
        response = wait_for(lambda: (r := https_post(url, trusting)).status_code == 200 and r, 30,
                            "a 200 over HTTPS", procs)
        assert len(response.json()["data"]) == 1

        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            https_post(url, ssl.create_default_context())  # a client that does not trust this CA
        with httpx.Client(timeout=10, trust_env=False) as client, pytest.raises(httpx.TransportError):
            client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings", json={"input": "plaintext"})
