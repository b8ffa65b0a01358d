"""mTLS between the control plane and its xDS clients, every part real: ``python -m control_plane`` with
``xds_tls_*``, ``python -m ext_proc`` with its ``xds_tls_*``, Envoy 1.40 on a bootstrap rendered with
``--xds-tls-*`` (an UpstreamTlsContext on the xds cluster), and a simulated worker; the certificates
come from a throwaway CA (trustme). The ADS server speaks nothing but mTLS then: a request goes
through Envoy and ext_proc only if both got their configuration over it, and clients without a
certificate, or with one but a node cluster the control plane does not serve, are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from control_plane.type_urls import CLUSTER

from .certs import Identity, Pki
from .conftest import free_port
from .stack import (
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)
from .xds_client import SotwClient

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def control_plane_tls(server: Identity) -> dict[str, str]:
    return {"INFERLB_CP_XDS_TLS_CERT": str(server.cert), "INFERLB_CP_XDS_TLS_KEY": str(server.key),
            "INFERLB_CP_XDS_TLS_CLIENT_CA": str(server.ca)}


def ext_proc_tls(client: Identity) -> dict[str, str]:
    return {"INFERLB_EXT_PROC_XDS_TLS_CERT": str(client.cert), "INFERLB_EXT_PROC_XDS_TLS_KEY": str(client.key),
            "INFERLB_EXT_PROC_XDS_TLS_CA": str(client.ca)}


async def refused(channel: grpc.aio.Channel, node_cluster: str) -> tuple[grpc.StatusCode | None, str]:
    """How the control plane ends a stream from this channel and node cluster (status, message)."""
    async with channel, SotwClient(channel, "stranger", node_cluster) as client:
        with contextlib.suppress(grpc.aio.AioRpcError):  # a failed handshake may fail the write itself
            await client.subscribe(CLUSTER)
        await client.wait_for(lambda: client.ended)
        assert client.received == []
        return client.code, client.details or ""


def test_envoy_and_ext_proc_get_their_config_over_mtls_and_strangers_are_refused(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    server, envoy_identity, ext_proc_identity = (pki.issue("control-plane", "127.0.0.1"), pki.issue("envoy"),
                                                 pki.issue("ext-proc"))
    ext_proc_port = free_port()
    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[worker.id], ext_proc_port=ext_proc_port,
                                  env=control_plane_tls(server)) as cp, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port,
                             env=ext_proc_tls(ext_proc_identity)) as ext_proc, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-mtls", bootstrap={
                "xds_tls_cert": str(envoy_identity.cert), "xds_tls_key": str(envoy_identity.key),
                "xds_tls_ca": str(envoy_identity.ca)}) as envoy:
        procs = [cp.proc, ext_proc.proc, envoy.proc, worker.proc]
        # ext_proc is ready only once its EDS arrived; Envoy is LIVE only once CDS and LDS did.
        wait_for(lambda: envoy.healthy_hosts() == {worker.id}, 30, "Envoy to see the worker healthy", procs)

        def picked_by_ext_proc() -> str | None:
            with http() as client:
                response = client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings", json={"input": "mTLS"})
            return response.headers.get("x-inferlb-endpoint") if response.status_code == 200 else None

        assert wait_for(picked_by_ext_proc, 30, "a 200 that ext_proc routed", procs) == worker.id
        with http() as client:
            clients = client.get(f"{cp.admin_url}/v1/xds/clients").json()
        listed = {c["node_id"]: c for c in clients["clients"]}
        assert listed["envoy-mtls"]["node_cluster"] == "inferlb" and listed["envoy-mtls"]["mode"] == "sotw"
        assert listed["ext-proc-test"]["node_cluster"] == "inferlb-ext-proc"

        address = f"127.0.0.1:{cp.xds_port}"
        ca = pki.ca.read_bytes()
        stranger = pki.issue("stranger")
        with_cert = grpc.ssl_channel_credentials(ca, stranger.key.read_bytes(), stranger.cert.read_bytes())

        async def strangers() -> dict[str, tuple[grpc.StatusCode | None, str]]:
            return {
                "plaintext": await refused(grpc.aio.insecure_channel(address), "inferlb"),
                "no client certificate": await refused(
                    grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)), "inferlb"),
                "unknown node cluster": await refused(
                    grpc.aio.secure_channel(address, with_cert), "intruders"),
            }

        outcomes = asyncio.run(asyncio.wait_for(strangers(), 60))
        assert outcomes["plaintext"][0] == grpc.StatusCode.UNAVAILABLE
        assert outcomes["no client certificate"][0] == grpc.StatusCode.UNAVAILABLE
        assert outcomes["unknown node cluster"] == (
            grpc.StatusCode.PERMISSION_DENIED,
            "xDS node cluster 'intruders' is not allowed (node id 'stranger'); allowed: inferlb, inferlb-ext-proc")
        assert sample(cp.metrics(), "inferlb_cp_xds_refused_total", reason="node_cluster") == 1
        assert "xDS client refused" in cp.proc.log()
        # the refused ones never disturbed the served ones
        assert picked_by_ext_proc() == worker.id
