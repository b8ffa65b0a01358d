"""The live half of ``inferlb bench rollout``: one stack whose workers serve two versions of one model,
a canary split measured over many requests, then blue-green switches and rollbacks timed.

Which version served a request is the worker's own word: the ``x-inferlb-model`` response header. A
switch or rollback is timed from just before its admin call to (a) every ext_proc replica having
ACKed the EDS version that carries it (``GET /v1/xds/clients``: rollouts travel to ext_proc only,
in its rich EDS; Envoys route where ext_proc tells them) and (b) the first response served by the
version switched to, while probe requests flow back to back. Before a switch every response names
the other version, so (b) can only come from a decision made after ext_proc applied the change.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from inferlb_runtime.model_routing import MODEL_HEADER

from ..ext_proc_bench.stack import wait_until
from ..processes import ProcessGroup
from ..routing.runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner
from ..load.scenario import Fleet, Scenario, WorkerSpec
from ..load.texts import embeddings_body

READY_TIMEOUT_S = 60.0  # for the control plane to have scraped every worker's models, ext_proc to have them
SWITCH_TIMEOUT_S = 10.0
EXT_PROC_CLUSTER = "inferlb-ext-proc"  # ext_proc's xDS node cluster (the rich EDS)


@dataclass(frozen=True)
class RolloutPlan:
    """What the bench runs."""

    alias: str = "all-MiniLM-L6-v2"
    stable: str = "all-MiniLM-L6-v2-int8"
    canary: str = "all-MiniLM-L6-v2-fp32"
    canary_percent: float = 10.0
    requests: int = 2000
    concurrency: int = 8
    switches: int = 5  # blue-green switch + rollback pairs timed
    probes: int = 4  # requests in flight while a switch is timed
    workers: int = 2
    tokens: int = 16  # per request: small, the bench measures routing, not inference
    seed: int = 1

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.canary_percent < 100:
            out.append(f"--canary-percent must be in (0, 100), got {self.canary_percent:g}")
        for name in ("requests", "concurrency", "switches", "probes", "workers", "tokens"):
            if getattr(self, name) < 1:
                out.append(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.stable == self.canary:
            out.append("the stable and canary versions must differ")
        return out


def rollout_scenario(plan: RolloutPlan) -> Scenario:
    """Simulated workers serving both versions, cheap enough that the bench measures the data plane."""
    fleet = Fleet(workers=tuple(WorkerSpec(1.0, 4) for _ in range(plan.workers)), cost_scale=1.0,
                  models=(plan.stable, plan.canary))
    return Scenario(name="rollout", seed=plan.seed, duration_s=1.0, warmup_s=0.0, slo_s=10.0,
                    request_timeout_s=10.0, loads=(1.0,), slowdown=None, fleet=fleet,
                    configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


class Admin:
    """The control plane's admin API, with the bench's token."""

    def __init__(self, client: httpx.AsyncClient, url: str, token: str) -> None:
        self.client, self.url, self.headers = client, url, {"Authorization": f"Bearer {token}"}

    async def call(self, method: str, path: str, json: Any = None) -> Any:
        response = await self.client.request(method, self.url + path, json=json, headers=self.headers)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    async def ext_proc_in_sync(self) -> bool:
        """Every connected ext_proc replica has ACKed the current EDS (and there is one)."""
        clients = [c for c in (await self.call("GET", "/v1/xds/clients"))["clients"]
                   if c["node_cluster"] == EXT_PROC_CLUSTER]
        return bool(clients) and all(c["types"].get("eds", {}).get("in_sync") and
                                     not c["types"]["eds"].get("nack_count") for c in clients)


class RolloutRunner(ScenarioRunner):
    """The stack, then the canary count and the timed switches."""

    def __init__(self, plan: RolloutPlan, out_dir: Path, report: Report) -> None:
        super().__init__(rollout_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.plan = plan
        self.body = embeddings_body(plan.tokens, model=plan.alias)

    async def run(self) -> dict[str, Any]:
        self._log.parent.mkdir(parents=True, exist_ok=True)
        dp = self._plan(CAPACITY_CONFIGURATION)
        assert dp.control_plane_url is not None and dp.admin_token is not None
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client, \
                ProcessGroup(report=self._log_line) as group:
            await self._start(group, dp, client)
            admin = Admin(client, dp.control_plane_url, dp.admin_token)
            await self._wait_for_catalogue(client, admin, group, dp.url)
            canary = await self._canary(client, admin, group, dp.url)
            switches = await self._switches(client, admin, group, dp.url)
            group.check_alive()
        return {"canary": canary, "switches": switches, "summary": summarise(canary, switches)}

    async def _wait_for_catalogue(self, client: httpx.AsyncClient, admin: Admin, group: ProcessGroup,
                                  url: str) -> None:
        """Until the control plane knows both versions and ext_proc lists them (GET /v1/models via Envoy)."""
        wanted = {self.plan.stable, self.plan.canary}
        models_url = url.rsplit("/v1/", 1)[0] + "/v1/models"

        async def listed() -> bool:
            response = await client.get(models_url)
            return response.status_code == 200 and wanted <= {m["id"] for m in response.json().get("data", [])}

        await wait_until(listed, READY_TIMEOUT_S, "ext_proc to list both versions", group)
        self.report(f"  the fleet serves {', '.join(sorted(wanted))} (GET /v1/models through Envoy)")

    async def _put(self, admin: Admin, group: ProcessGroup, split: dict[str, float]) -> None:
        await admin.call("PUT", f"/v1/rollouts/{self.plan.alias}", {"versions": split, "sticky": "none"})
        await wait_until(admin.ext_proc_in_sync, SWITCH_TIMEOUT_S, "ext_proc to ACK the rollout", group)

    async def _send(self, client: httpx.AsyncClient, url: str) -> tuple[int, str | None]:
        # no-store: every request is decided and served (one repeated body would be ext_proc's cache's)
        response = await client.post(url, content=self.body, headers={"content-type": "application/json",
                                                                      "cache-control": "no-store"})
        return response.status_code, response.headers.get(MODEL_HEADER)

    async def _canary(self, client: httpx.AsyncClient, admin: Admin, group: ProcessGroup,
                      url: str) -> dict[str, Any]:
        plan = self.plan
        split = {plan.stable: 100.0 - plan.canary_percent, plan.canary: plan.canary_percent}
        await self._put(admin, group, split)
        self.report(f"  canary {plan.canary} at {plan.canary_percent:g}%: {plan.requests} requests naming "
                    f"{plan.alias}, {plan.concurrency} at a time")
        served: Counter[str] = Counter()
        failures: Counter[str] = Counter()
        remaining = iter(range(plan.requests))
        started = time.monotonic()

        async def loop() -> None:
            for _ in remaining:
                try:
                    status, version = await self._send(client, url)
                except httpx.HTTPError as exc:
                    failures[type(exc).__name__] += 1
                    continue
                if status == 200 and version:
                    served[version] += 1
                else:
                    failures[f"HTTP {status}" if status != 200 else "no version header"] += 1

        await asyncio.gather(*(loop() for _ in range(plan.concurrency)))
        elapsed = time.monotonic() - started
        share = served[plan.canary] / plan.requests
        self.report(f"    {served[plan.canary]} of {plan.requests} served by the canary ({share:.1%}), "
                    f"{sum(failures.values())} failed, in {elapsed:.1f} s")
        return {"split": split, "requests": plan.requests, "served": dict(served), "failures": dict(failures),
                "canary_share": round(share, 4), "target": plan.canary_percent / 100, "tolerance": 0.02,
                "within_target": abs(share - plan.canary_percent / 100) <= 0.02, "elapsed_s": round(elapsed, 2)}

    async def _switches(self, client: httpx.AsyncClient, admin: Admin, group: ProcessGroup,
                        url: str) -> list[dict[str, Any]]:
        """``switches`` times: stable 100% -> blue-green switch to the canary -> rollback; both timed."""
        plan = self.plan
        out = []
        for i in range(plan.switches):
            await self._put(admin, group, {plan.stable: 100.0})
            switch = await self._timed(client, admin, group, url, plan.canary,
                                       lambda: admin.call("PUT", f"/v1/rollouts/{plan.alias}",
                                                          {"versions": {plan.canary: 100.0}, "sticky": "none"}))
            rollback = await self._timed(client, admin, group, url, plan.stable,
                                         lambda: admin.call("POST", f"/v1/rollouts/{plan.alias}/rollback"))
            self.report(f"  [{i + 1}/{plan.switches}] switch to {plan.canary}: acked by ext_proc in "
                        f"{switch['acked_s'] * 1e3:.0f} ms, first response in {switch['first_response_s'] * 1e3:.0f} ms;"
                        f" rollback: {rollback['acked_s'] * 1e3:.0f} ms, {rollback['first_response_s'] * 1e3:.0f} ms")
            out.append({"switch": switch, "rollback": rollback})
        return out

    async def _timed(self, client: httpx.AsyncClient, admin: Admin, group: ProcessGroup, url: str, target: str,
                     change: Callable[[], Any]) -> dict[str, Any]:
        """Run ``change`` while probes flow; seconds until ext_proc ACKed it and until ``target`` served one."""
        loop = asyncio.get_running_loop()
        first: asyncio.Future[float] = loop.create_future()
        failures: Counter[str] = Counter()
        stop = asyncio.Event()
        sent = 0

        async def probe() -> None:
            nonlocal sent
            deadline = loop.time() + SWITCH_TIMEOUT_S
            while not stop.is_set() and loop.time() < deadline:
                sent += 1
                try:
                    status, version = await self._send(client, url)
                except httpx.HTTPError as exc:
                    failures[type(exc).__name__] += 1
                    continue
                if status != 200:
                    failures[f"HTTP {status}"] += 1
                elif version == target and not first.done():
                    first.set_result(loop.time())

        probes = [asyncio.ensure_future(probe()) for _ in range(self.plan.probes)]
        try:
            t0 = loop.time()
            await change()
            answered = loop.time()
            while not await admin.ext_proc_in_sync():  # every 10 ms: the figure is in milliseconds
                group.check_alive()
                if loop.time() - t0 > SWITCH_TIMEOUT_S:
                    raise TimeoutError(f"ext_proc did not ACK the change within {SWITCH_TIMEOUT_S:g} s")
                await asyncio.sleep(0.01)
            acked = loop.time()
            first_at = await asyncio.wait_for(asyncio.shield(first), SWITCH_TIMEOUT_S)
        finally:
            stop.set()
            await asyncio.gather(*probes)
        return {"to": target, "admin_call_s": round(answered - t0, 4), "acked_s": round(acked - t0, 4),
                "first_response_s": round(first_at - t0, 4), "probes_sent": sent, "failures": dict(failures)}


def summarise(canary: dict[str, Any], switches: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the issue's targets name: the canary's share, and the slowest switch and rollback."""
    rollbacks = [s["rollback"] for s in switches]
    forwards = [s["switch"] for s in switches]
    failures = sum(sum(t["failures"].values()) for s in switches for t in s.values()) + \
        sum(canary["failures"].values())

    def slowest(timings: list[dict[str, Any]], key: str) -> float:
        return max((t[key] for t in timings), default=0.0)

    rollback_s = max(slowest(rollbacks, "acked_s"), slowest(rollbacks, "first_response_s"))
    return {"canary_share": canary["canary_share"], "canary_within_target": canary["within_target"],
            "switch_acked_max_s": slowest(forwards, "acked_s"),
            "switch_first_response_max_s": slowest(forwards, "first_response_s"),
            "rollback_acked_max_s": slowest(rollbacks, "acked_s"),
            "rollback_first_response_max_s": slowest(rollbacks, "first_response_s"),
            "rollback_within_target": rollback_s <= 1.0, "failures": failures}
