"""API keys and quotas through the real wire, seen by the official OpenAI SDK.

The stack is the production one (control plane, ext_proc, Envoy, simulated workers) with keys required:
the operator issues a key on the admin API, the control plane pushes its hash to ext_proc over xDS, and
ext_proc checks every request before routing it. The SDK must see our 401 as ``AuthenticationError`` and
our 429 as ``RateLimitError``, with OpenAI's rate-limit headers; a refused request never reaches a worker.
A quota is made certain rather than timed: two requests per minute, so the third within the minute is
over it whatever the machine's speed (a minute is far longer than the test). The second test keeps the
counters in a real Redis (Debian's redis-server) and takes from them as another replica would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ext_proc.quota.redis_store import RedisQuotaStore
from inferlb_runtime.api_keys import Quota

from .stack import http, running_gateway, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]
pytest_plugins = ("tests.redis_server",)  # the redis_url fixture: Debian's redis-server, started for the suite

REQUIRE = {"INFERLB_CP_DATA_PLANE__REQUIRE_API_KEYS": "true"}
EXT_PROC_REQUIRE = {"INFERLB_EXT_PROC_REQUIRE_API_KEYS": "true"}


def _sdk(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30,
                         http_client=httpx.Client(trust_env=False))


def _worker_requests(workers: Any) -> float:
    """Embedding requests the workers answered, whatever their status."""
    return sum(value for w in workers for (name, _), value in w.metrics().items()
               if name == "inferlb_worker_requests_total")


def test_keys_and_quotas_through_envoy_as_the_openai_sdk_sees_them(tmp_path: Path) -> None:
    with running_gateway(tmp_path, name="tenants", cp_env=REQUIRE, ext_proc_env=EXT_PROC_REQUIRE) as gw:
        workers, ext_proc, procs, admin = gw.workers, gw.ext_proc, gw.procs, gw.admin
        port = gw.cp.listener_port
        url = gw.url()
        before = _worker_requests(workers)

        # No key: 401 at the gateway, in OpenAI's shape.
        with http() as client:
            missing = client.post(url, json={"input": "a sentence"}, timeout=30)
        assert missing.status_code == 401, missing.text
        assert missing.json()["error"]["code"] == "invalid_api_key"
        # An unknown key: the SDK's AuthenticationError.
        with pytest.raises(openai.AuthenticationError) as refused:
            _sdk(port, "ilb-not-a-key").embeddings.create(model="all-MiniLM-L6-v2", input="a sentence")
        assert refused.value.code == "invalid_api_key"

        created = admin("POST", "/v1/api-keys", {"tenant": "acme", "requests_per_minute": 3,
                                                     "tokens_per_minute": 100_000, "priority": "sheddable"})
        assert created.status_code == 201, created.text
        key, key_id = created.json()["key"], created.json()["id"]
        sdk = _sdk(port, key)

        def accepted() -> bool:  # until ext_proc has the pushed table: 401 (consumes nothing)
            with http() as client:
                return client.get(f"http://127.0.0.1:{port}/v1/models",
                                  headers={"authorization": f"Bearer {key}"}, timeout=30).status_code == 200
        wait_for(accepted, 30, "ext_proc to receive the new key", procs)  # request 1 of 3 this minute

        raw = sdk.embeddings.with_raw_response.create(model="all-MiniLM-L6-v2", input="a sentence",
                                                      extra_headers={"x-gateway-inference-objective": "critical"})
        assert raw.http_response.status_code == 200  # request 2
        headers = raw.headers
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-remaining-requests"] == "1"
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(headers["x-ratelimit-remaining-tokens"]) < 100_000
        assert headers["x-ratelimit-reset-requests"] and headers["x-ratelimit-reset-tokens"]
        sdk.embeddings.create(model="all-MiniLM-L6-v2", input="another")  # request 3

        with pytest.raises(openai.RateLimitError) as limited:
            sdk.embeddings.create(model="all-MiniLM-L6-v2", input="one too many")
        error = limited.value
        assert error.code == "rate_limit_exceeded"
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(error.response.headers["retry-after"]) >= 1
        assert "requests per min" in error.message

        # The key's class is the best a request may claim: the worker queued the "critical" one as sheddable.
        worker_metrics = workers[0].metrics()
        assert sample(worker_metrics, "inferlb_worker_queue_wait_by_class_seconds_count", priority="sheddable") == 2
        assert not sample(worker_metrics, "inferlb_worker_queue_wait_by_class_seconds_count", priority="critical")
        # Refused requests never reached the worker: it answered exactly the two embeddings served.
        assert _worker_requests(workers) - before == 2

        metrics = ext_proc.metrics()
        assert sample(metrics, "inferlb_ext_proc_tenant_requests_total", tenant="acme", outcome="served") == 3
        assert sample(metrics, "inferlb_ext_proc_tenant_requests_total", tenant="acme", outcome="rate_limited") == 1
        assert sample(metrics, "inferlb_ext_proc_auth_failures_total", reason="missing_key") == 1
        assert sample(metrics, "inferlb_ext_proc_auth_failures_total", reason="invalid_key") >= 1

        # Revoked: refused again once ext_proc has the new table.
        assert admin("DELETE", f"/v1/api-keys/{key_id}").status_code == 200

        def refused_again() -> bool:
            try:
                sdk.models.list()
            except openai.AuthenticationError:
                return True
            except openai.RateLimitError:
                return False
            return False
        wait_for(refused_again, 30, "the revoked key to be refused", procs)


def test_the_quota_lives_in_redis_and_binds_every_replica(tmp_path: Path, redis_url: str) -> None:
    """ext_proc behind Envoy keeps the tenant's counters in a real Redis: what another replica (here a store
    of the same code in the test) takes from the quota there, the request through Envoy no longer gets."""
    store_env = {**EXT_PROC_REQUIRE, "INFERLB_EXT_PROC_QUOTA_STORE": redis_url}
    with running_gateway(tmp_path, name="redis", cp_env=REQUIRE, ext_proc_env=store_env) as gw:
        created = gw.admin("POST", "/v1/api-keys", {"tenant": "shared", "tokens_per_minute": 1000})
        assert created.status_code == 201, created.text
        key = created.json()["key"]
        sdk = _sdk(gw.cp.listener_port, key)

        def accepted() -> bool:
            try:
                sdk.embeddings.create(model="all-MiniLM-L6-v2", input="a sentence")
            except openai.AuthenticationError:
                return False
            return True
        wait_for(accepted, 30, "ext_proc to receive the new key", gw.procs)
        raw = sdk.embeddings.with_raw_response.create(model="all-MiniLM-L6-v2", input="a sentence")
        remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
        assert 0 < remaining < 1000

        async def other_replica_takes_the_rest() -> None:
            store = RedisQuotaStore.from_url(redis_url, timeout_s=5.0)
            try:
                outcome = await store.acquire("shared", Quota(tokens_per_minute=1000), remaining)
                assert outcome.admitted, outcome
            finally:
                await store.aclose()
        asyncio.run(other_replica_takes_the_rest())

        with pytest.raises(openai.RateLimitError) as limited:
            sdk.embeddings.create(model="all-MiniLM-L6-v2", input="a sentence")
        assert limited.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
        assert sample(gw.ext_proc.metrics(), "inferlb_ext_proc_quota_decisions_total", result="limited") == 1
