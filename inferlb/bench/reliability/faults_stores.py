"""The faults of what the stack keeps its state in, or is told by: Redis down or slow (ext_proc's quotas and
shared cache), a config Envoy NACKs (the control plane's), PostgreSQL down under two control-plane replicas
(their shared store). Each fault's steps are ``StoreFaults`` methods named after it (see ``faults_steps.py``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..stack.dataplanes.envoy_admin import envoy_stat, host_weight
from .faults_steps import CACHE_HEADER, ENDPOINT_HEADER, FaultSteps

QUOTA_METRIC = "inferlb_ext_proc_quota_decisions_total"
CACHE_METRIC = "inferlb_ext_proc_cache_requests_total"
STORE_ERRORS_METRIC = "inferlb_ext_proc_quota_store_errors_total"
FAULT_TENANT = "faults"
RATE_LIMIT_HEADER = "x-ratelimit-limit-requests"  # on every answer to a key with a quota, once checked
PIN_WHILE_DOWN = 7  # postgres_down: the pin refused while PostgreSQL is down (never applied)
PIN_WHEN_BACK = 100  # postgres_down: the pin through replica B once it is back (the default weight: no shift)


class StoreFaults(FaultSteps):
    """The steps of the faults of Redis, PostgreSQL and the served config."""

    # --- Redis down or slow: quotas fail open or closed as configured, the shared cache misses, nothing else -

    async def quota_key(self, body: bytes) -> None:
        """An API key with a quota too large to bind, so every request's quota is checked in Redis; ready when
        a request with it is answered with its rate-limit headers (ext_proc has the key from xDS)."""
        response = await self.client.post(
            f"{self.dp.control_plane_url}/v1/api-keys", json={"tenant": FAULT_TENANT, "requests_per_minute": 10**9},
            headers={"Authorization": f"Bearer {self.dp.admin_token}"})
        response.raise_for_status()
        self.headers = {"Authorization": f"Bearer {response.json()['key']}"}

        async def checked() -> bool:
            answer = await self.client.post(self.dp.url, content=body,
                                            headers={**self.headers, "Content-Type": "application/json"})
            return answer.status_code == 200 and RATE_LIMIT_HEADER in answer.headers

        if await self.wait(checked, 30.0, "quota-checked answer") is None:
            raise RuntimeError(f"{self.name}: ext_proc never checked the API key's quota")

    async def ext_proc_counts(self) -> dict[str, int]:
        """ext_proc's quota decisions by result (``quota:…``), quota-store calls not answered by reason
        (``store:…``) and its cache lookups by ``level:result``."""
        text = (await self.client.get(f"{self.dp.ext_proc_metrics_url}/metrics")).text
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == QUOTA_METRIC:
                    out[f"quota:{sample.labels['result']}"] += int(sample.value)
                elif sample.name == STORE_ERRORS_METRIC:
                    out[f"store:{sample.labels['reason']}"] += int(sample.value)
                elif sample.name == CACHE_METRIC:
                    out[f"cache:{sample.labels['level']}:{sample.labels['result']}"] += int(sample.value)
        return dict(out)

    def _store_failure(self) -> str:
        return "quota:failed_closed" if self.name == "redis_down_closed" else "quota:failed_open"

    async def inject_redis_down(self) -> None:
        assert self.setup.redis is not None
        self.counts_injected = await self.ext_proc_counts()
        await self.setup.redis.kill()

    async def reacted_redis_down(self) -> bool:
        failure = self._store_failure()
        return (await self.ext_proc_counts()).get(failure, 0) > self.counts_injected.get(failure, 0)

    async def hold_redis_down(self, reacted: float) -> dict[str, Any]:
        """Keep it down while the baseline's count of requests is answered: how were they answered?"""
        counts0 = await self.ext_proc_counts()
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        counts1 = await self.ext_proc_counts()
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "picked_while_held": sum(ENDPOINT_HEADER in a.headers for a in held),
                "cache_hits_while_held": sum(a.headers.get(CACHE_HEADER) == "hit" for a in held),
                "ext_proc_while_held": {k: v - counts0.get(k, 0) for k, v in sorted(counts1.items())
                                        if v != counts0.get(k, 0)}}

    async def restore_redis_down(self) -> None:
        assert self.setup.redis is not None
        self.counts_restored = await self.ext_proc_counts()
        self.restored_at = self.now()
        await self.setup.redis.start()  # on its port, empty

    async def back_redis_down(self) -> bool:
        """A quota checked in Redis again (admitted), and a client served since the restore."""
        counts = await self.ext_proc_counts()
        if counts.get("quota:admitted", 0) > self.counts_restored.get("quota:admitted", 0) \
                and await self.answered(1, self.restored_at):
            self.counts_back = counts
            return True
        return False

    async def figures_redis_down(self) -> dict[str, Any]:
        """Quota-store calls not answered since it was back, by reason: a timeout (a stalled host) fails the
        next half second of checks by design; an error would be a stale connection to the old Redis."""
        counts = await self.ext_proc_counts()
        return {"store_unanswered_after_back": {k: v - self.counts_back.get(k, 0) for k, v in sorted(counts.items())
                                                if k.startswith("store:") and v != self.counts_back.get(k, 0)}}

    inject_redis_down_closed = inject_redis_down
    reacted_redis_down_closed = reacted_redis_down
    hold_redis_down_closed = hold_redis_down
    restore_redis_down_closed = restore_redis_down
    back_redis_down_closed = back_redis_down
    figures_redis_down_closed = figures_redis_down

    async def inject_redis_slow(self) -> None:
        assert self.setup.redis_proxy is not None
        self.counts_injected = await self.ext_proc_counts()
        self.setup.redis_proxy.delay_s = self.plan.redis_delay_s

    reacted_redis_slow = reacted_redis_down
    hold_redis_slow = hold_redis_down

    async def restore_redis_slow(self) -> None:
        assert self.setup.redis_proxy is not None
        self.counts_restored = await self.ext_proc_counts()
        self.restored_at = self.now()
        self.setup.redis_proxy.delay_s = 0.0

    back_redis_slow = back_redis_down

    # --- a NACKed config: traffic goes on with the last good one; the NACK shows in the admin API -----------

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.dp.admin_token}"}

    async def envoy_eds(self) -> dict[str, Any] | None:
        """Envoy's EDS status in ``GET /v1/xds/clients`` (Envoy: the client without ext_proc's key table)."""
        response = await self.client.get(f"{self.dp.control_plane_url}/v1/xds/clients", headers=self._admin())
        response.raise_for_status()
        envoys = [c for c in response.json()["clients"] if "keys" not in c["types"]]
        return envoys[0]["types"].get("eds") if len(envoys) == 1 else None

    async def _pin(self, weight: int | None) -> None:
        """A change of EDS for the control plane to publish (pin the target's weight; None: unpin)."""
        url = f"{self.dp.control_plane_url}/v1/endpoints/{self.target_worker}/weight"
        response = await (self.client.put(url, json={"weight": weight}, headers=self._admin()) if weight
                          else self.client.delete(url, headers=self._admin()))
        response.raise_for_status()

    async def inject_config_nack(self) -> None:
        assert self.setup.nack_flag is not None
        self.setup.nack_flag.touch()
        await self._pin(50)

    async def reacted_config_nack(self) -> bool:
        eds = await self.envoy_eds()
        return eds is not None and eds["nack_count"] > 0

    async def hold_config_nack(self, reacted: float) -> dict[str, Any]:
        """Keep the bad config current while the baseline's count of requests is answered."""
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        eds = await self.envoy_eds() or {}
        stats = (await self.client.get(f"{self.dp.envoy_admin_url}/stats")).text
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "nack_count": eds.get("nack_count"), "last_nack": (eds.get("last_nack") or {}).get("message"),
                "in_sync_while_held": eds.get("in_sync"),
                "envoy_update_rejected": envoy_stat(stats, "cluster.workers.update_rejected")}

    async def restore_config_nack(self) -> None:
        assert self.setup.nack_flag is not None
        self.setup.nack_flag.unlink()
        self.restored_at = self.now()
        await self._pin(None)

    async def back_config_nack(self) -> bool:
        """Envoy ACKed the good config published after the restore, and served."""
        eds = await self.envoy_eds()
        return eds is not None and eds["in_sync"] and await self.answered(1, self.restored_at)

    # --- PostgreSQL down under two control-plane replicas: serving goes on, mutations get a clear 503, and
    # the replicas converge when it returns ----------------------------------------------------------------

    def _replica_urls(self) -> dict[str, str]:
        assert self.dp.control_plane_url is not None and self.setup.replica_b_url is not None
        return {"a": self.dp.control_plane_url, "b": self.setup.replica_b_url}

    async def _mutate(self, replica: str, weight: int) -> dict[str, Any]:
        """Pin the target's weight through ``replica``: the answer's status, error code and time (a hang shows
        as ``timeout`` after the client's 5 s)."""
        url = f"{self._replica_urls()[replica]}/v1/endpoints/{self.target_worker}/weight"
        started = self.loop.time()
        try:
            response = await self.client.put(url, json={"weight": weight}, headers=self._admin())
        except httpx.TimeoutException:
            return {"replica": replica, "status": "timeout", "at_s": round(self.now(), 3)}
        try:
            body = response.json()
        except ValueError:
            body = {}
        error = body.get("error") if isinstance(body, dict) else None
        return {"replica": replica, "status": response.status_code, "at_s": round(self.now(), 3),
                "took_s": round(self.loop.time() - started, 3),
                "code": error.get("code") if isinstance(error, dict) else None,
                # the admin API's one error shape: {"error": {"status", "code", "message", "detail"}}
                "error_shape": isinstance(error, dict) and {"status", "code", "message", "detail"} <= set(error)
                and error["status"] == response.status_code,
                "message": error.get("message") if isinstance(error, dict) else None}

    async def _pinned(self, replica: str) -> int | None:
        url = f"{self._replica_urls()[replica]}/v1/endpoints/{self.target_worker}"
        response = await self.client.get(url, headers=self._admin())
        response.raise_for_status()
        pinned = response.json()["weight"]["pinned"]
        return None if pinned is None else int(pinned)

    async def inject_postgres_down(self) -> None:
        assert self.setup.postgres is not None
        self.mutations: list[dict[str, Any]] = []
        self.refused: set[str] = set()
        await self.setup.postgres.shutdown_immediately()

    async def reacted_postgres_down(self) -> bool:
        """Each replica refused a pin with 503 ``store_unavailable`` (each is asked until it has)."""
        for replica in sorted(set(self._replica_urls()) - self.refused):
            answer = await self._mutate(replica, PIN_WHILE_DOWN)
            self.mutations.append(answer)
            if answer["status"] == 503 and answer["code"] == "store_unavailable" and answer["error_shape"]:
                self.refused.add(replica)
        return self.refused == set(self._replica_urls())

    async def hold_postgres_down(self, reacted: float) -> dict[str, Any]:
        """Keep it down while the baseline's count of requests is answered; then each replica is asked once
        more, and neither shows the refused pin."""
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        for replica in sorted(self._replica_urls()):
            self.mutations.append(await self._mutate(replica, PIN_WHILE_DOWN))
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "picked_while_held": sum(ENDPOINT_HEADER in a.headers for a in held),
                "pinned_while_down": {r: await self._pinned(r) for r in sorted(self._replica_urls())}}

    async def restore_postgres_down(self) -> None:
        assert self.setup.postgres is not None
        self.restored_at = self.now()
        self.converging: list[dict[str, Any]] = []  # the pins through B until one is saved
        await self.setup.postgres.start()  # same data directory and port: crash recovery, every row kept

    async def back_postgres_down(self) -> bool:
        """A pin through replica B saved, shown by replica A and applied by A's Envoy; ext_proc picks again
        and every worker is healthy."""
        if not any(m["status"] == 200 for m in self.converging):
            self.converging.append(await self._mutate("b", PIN_WHEN_BACK))
            if self.converging[-1]["status"] != 200:
                return False
        if await self._pinned("a") != PIN_WHEN_BACK:
            return False
        if host_weight(await self.clusters(), self.target) != PIN_WHEN_BACK:
            return False
        picked = any(ENDPOINT_HEADER in a.headers for a in self.timeline.succeeded_since(self.restored_at))
        return picked and await self.every_worker_healthy()

    async def figures_postgres_down(self) -> dict[str, Any]:
        return {"mutations_while_down": list(getattr(self, "mutations", [])),
                "mutations_converging": list(getattr(self, "converging", [])),
                "pinned_after": {r: await self._pinned(r) for r in sorted(self._replica_urls())}}
