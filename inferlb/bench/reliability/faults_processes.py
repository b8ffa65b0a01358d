"""The faults of the stack's own processes: a worker killed, stopped or answering 500 fast or late, ext_proc
and the control plane killed, Envoy restarted. Each fault's steps are ``ProcessFaults`` methods named after it
(see ``faults_steps.py``)."""

from __future__ import annotations

import signal
from typing import Any

from .faults_steps import ENDPOINT_HEADER, FaultSteps, host_share


class ProcessFaults(FaultSteps):
    """The steps of the faults of the stack's processes."""

    # --- kill -9 a worker: retried elsewhere; it leaves, and returns with slow start when restarted -----

    async def inject_worker_kill(self) -> None:
        self.worker_spec = await self.group.kill(self._worker_name())

    async def reacted_worker_kill(self) -> bool:
        return await self.target_flags() != "healthy"

    async def restore_worker_kill(self) -> None:
        self.restored_at = self.now()
        await self.group.start([self.worker_spec])

    async def back_worker_kill(self) -> bool:
        return await self.target_serves(self.restored_at)

    # --- SIGSTOP a worker, then SIGCONT: timeouts and health checks route around it -----------------

    def _worker_name(self) -> str:
        return f"worker:{self.target_worker.rsplit(':', 1)[1]}"

    async def inject_worker_stop(self) -> None:
        self.group.send_signal(self._worker_name(), signal.SIGSTOP)

    reacted_worker_stop = reacted_worker_kill

    async def restore_worker_stop(self) -> None:
        self.restored_at = self.now()
        self.group.send_signal(self._worker_name(), signal.SIGCONT)

    back_worker_stop = back_worker_kill

    # --- kill ext_proc: Envoy fails open; restarted, it routes again with a fresh view ----------------

    async def inject_ext_proc_kill(self) -> None:
        self.killed_at = self.now()
        self.ext_proc_spec = await self.group.kill("ext_proc")

    async def reacted_ext_proc_kill(self) -> bool:  # a request served without ext_proc's pick: fail-open
        return any(ENDPOINT_HEADER not in a.headers for a in self.timeline.succeeded_since(self.killed_at))

    async def restore_ext_proc_kill(self) -> None:
        await self.group.start([self.ext_proc_spec])
        self.restored_at = self.now()

    async def back_ext_proc_kill(self) -> bool:
        return any(ENDPOINT_HEADER in a.headers for a in self.timeline.succeeded_since(self.restored_at))

    # --- kill the control plane: the last good state serves; restarted, it restores and clients resync --

    async def inject_control_plane_kill(self) -> None:
        self.killed_at = self.now()
        self.control_plane_spec = await self.group.kill("control-plane")

    async def reacted_control_plane_kill(self) -> bool:  # serving goes on without it (the baseline's count again)
        return await self.answered(self.plan.baseline, self.killed_at)

    async def restore_control_plane_kill(self) -> None:
        await self.group.start([self.control_plane_spec])

    async def back_control_plane_kill(self) -> bool:
        """Envoy and ext_proc reconnected to the restarted control plane and ACKed its current config."""
        response = await self.client.get(f"{self.dp.control_plane_url}/v1/xds/clients",
                                         headers={"Authorization": f"Bearer {self.dp.admin_token}"})
        clients = response.json().get("clients", []) if response.status_code == 200 else []
        groups = {c["node_cluster"] for c in clients}
        synced = all(t.get("in_sync") for c in clients for t in c["types"].values())
        return len(groups) >= 2 and synced and await self.every_worker_healthy()

    # --- restart Envoy: configured from xDS alone ------------------------------------------------------

    async def inject_envoy_restart(self) -> None:
        self.killed_envoy = await self.envoy_counters()
        self.envoy_spec = await self.group.kill("envoy")

    async def reacted_envoy_restart(self) -> bool:
        return True  # nothing listens: the requests now fail; restart at once

    async def restore_envoy_restart(self) -> None:
        await self.group.start([self.envoy_spec])
        self.restored_at = self.now()

    async def back_envoy_restart(self) -> bool:
        return await self.every_worker_healthy() and await self.answered(1, self.restored_at)

    # --- a worker that answers 500 fast: no traffic for looking fast; weight drops, outlier detection ejects -

    async def _fail_rate(self, rate: float) -> None:
        response = await self.client.put(f"http://{self.target_worker}/v1/simulation", json={"fail_rate": rate})
        response.raise_for_status()

    async def inject_worker_500(self) -> None:
        await self._fail_rate(1.0)

    async def reacted_worker_500(self) -> bool:
        return "failed_outlier_check" in (await self.target_flags() or "")

    async def hold_worker_500(self, reacted: float) -> dict[str, Any]:
        """Keep it failing while the baseline's count of requests is served: what share does it still get?"""
        hosts0 = await self.hosts()
        await self.wait(lambda: self.answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        endpoint = (await self.client.get(f"{self.dp.control_plane_url}/v1/endpoints/{self.target_worker}")).json()
        return {"target_share_while_held": host_share(hosts0, await self.hosts(), self.target),
                "target_weight_after_hold": endpoint.get("weight"),
                "held_s": round(self.now() - reacted, 3), "target_flags_after_hold": await self.target_flags()}

    async def restore_worker_500(self) -> None:
        self.restored_at = self.now()
        await self._fail_rate(0.0)

    back_worker_500 = back_worker_kill

    # --- delay in front of one worker (a delaying TCP proxy): it gets less traffic ---------------------

    async def inject_worker_delay(self) -> None:
        assert self.setup.proxy is not None
        self.setup.proxy.delay_s = self.plan.worker_delay_s

    async def reacted_worker_delay(self) -> bool:
        return True  # nothing is ejected: the measure is the share it gets while delayed (hold)

    async def hold_worker_delay(self, reacted: float) -> dict[str, Any]:
        """Keep it delayed while the baseline's count of requests is served: its share then, and before."""
        hosts0 = await self.hosts()
        await self.wait(lambda: self.answered(self.plan.delay_hold, reacted), self.plan.react_timeout_s, "hold")
        return {"delay_s": self.plan.worker_delay_s,
                "target_share_before": host_share(self.hosts_start, self.hosts_injected, self.target),
                "target_share_while_held": host_share(hosts0, await self.hosts(), self.target),
                "held_s": round(self.now() - reacted, 3)}

    async def restore_worker_delay(self) -> None:
        assert self.setup.proxy is not None
        self.restored_at = self.now()
        self.setup.proxy.delay_s = 0.0

    back_worker_delay = back_worker_kill
