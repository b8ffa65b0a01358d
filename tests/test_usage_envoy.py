"""Usage for billing end to end: requests through Envoy and ext_proc, read back from ``GET /v1/usage``.

The production stack (control plane, ext_proc, Envoy, simulated workers), keys not required: a request
with a tenant's API key counts for that tenant, one without a key for ``anonymous``. ext_proc counts
each finished request; the control plane reads the counters from its /metrics (the replica watch's
scrape) and keeps them in its store; /v1/usage answers them, equal to what ext_proc counted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .stack import http, running_gateway, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def test_requests_through_envoy_are_read_back_from_v1_usage(tmp_path: Path) -> None:
    with running_gateway(tmp_path, name="usage") as gw:
        ext_proc, procs, admin = gw.ext_proc, gw.procs, gw.admin

        created = admin("POST", "/v1/api-keys", {"tenant": "acme"})
        assert created.status_code == 201, created.text
        key = created.json()["key"]

        def key_acked() -> bool:
            clients = admin("GET", "/v1/xds/clients").json()["clients"]
            keys = next((c["types"].get("keys") for c in clients if c["node_id"] == "ext-proc-usage"), None)
            return keys is not None and keys["in_sync"]
        wait_for(key_acked, 30, "ext_proc to ack the key table with the new key", procs)

        url = gw.url()
        with http() as client:
            for headers in [{"authorization": f"Bearer {key}"}] * 3 + [{}] * 2:
                response = client.post(url, json={"input": "a sentence to bill"}, headers=headers, timeout=30)
                assert response.status_code == 200, response.text

        def counted(tenant: str) -> tuple[float | None, float | None]:
            metrics = ext_proc.metrics()
            return (sample(metrics, "inferlb_ext_proc_tenant_requests_total", tenant=tenant, outcome="served"),
                    sample(metrics, "inferlb_ext_proc_tenant_tokens_total", tenant=tenant, outcome="served"))

        wait_for(lambda: counted("acme")[0] == 3 and counted("anonymous")[0] == 2, 30,
                 "ext_proc to count the finished requests", procs)
        acme_tokens, anonymous_tokens = counted("acme")[1], counted("anonymous")[1]
        assert acme_tokens and anonymous_tokens and acme_tokens == 3 * anonymous_tokens / 2

        def usage() -> dict:
            response = admin("GET", "/v1/usage?granularity=minute")
            assert response.status_code == 200, response.text
            return {t["tenant"]: t["totals"] for t in response.json()["tenants"]}

        totals = wait_for(lambda: (u := usage()).get("acme", {}).get("requests") == 3
                          and u.get("anonymous", {}).get("requests") == 2 and u, 30,
                          "the usage in /v1/usage", procs)
        zero = {"errors": 0, "sheds": 0, "rate_limited": 0, "unauthenticated": 0}
        assert totals["acme"] == {"requests": 3, "tokens": int(acme_tokens), **zero}
        assert totals["anonymous"] == {"requests": 2, "tokens": int(anonymous_tokens), **zero}
        only = admin("GET", "/v1/usage?tenant=acme").json()["tenants"]
        assert [t["tenant"] for t in only] == ["acme"] and only[0]["totals"] == totals["acme"]
