"""The children of one configuration: the client fleet and the real Envoy, in a ``ProcessGroup``.

Both start together (their start-ups overlap) and are stopped on the way out,
whatever happens; if the configuration's process dies, they get SIGTERM too
(the group's children die with their parent). The fleet writes one JSON line
per response its clients receive to its log; they are read after the rounds.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import psutil

from ...bootstrap import render_bootstrap
from ...supervisor import Component, log_tail
from ..stack.fleet import child_env
from ..processes import ComponentDied, ProcessGroup, free_port
from .spec import ENVOY_NODE, Spec

FLEET = "client-fleet"
ENVOY = "envoy"


class Children:
    def __init__(self, workdir: Path, group: ProcessGroup) -> None:
        self.workdir = workdir
        self.group = group
        self.fleet_log = workdir / "client-fleet.log"
        self.envoy_log = workdir / "envoy.log"
        self.started: list[str] = []

    def fleet_component(self, spec: Spec, target: str, route_name: str) -> Component:
        ready_port = free_port()
        fleet_spec = {"target": target, "mode": spec.mode, "clients": spec.fakes, "route": route_name,
                      "deadline_s": spec.sync_timeout_s + (spec.rounds + spec.warmup) * spec.round_timeout_s + 60}
        return Component(name=FLEET, argv=[sys.executable, "-m", "inferlb.bench.xds_bench.fleet",
                                           json.dumps(fleet_spec), str(ready_port)],
                         ready_url=f"http://127.0.0.1:{ready_port}/", log_path=self.fleet_log, env=child_env(),
                         ready_timeout_s=spec.sync_timeout_s)

    def envoy_component(self, spec: Spec, xds_port: int) -> Component:
        admin_port = free_port()
        config = self.workdir / "envoy.yaml"
        config.write_text(render_bootstrap(node_id=ENVOY_NODE, node_cluster="inferlb", xds_port=xds_port,
                                           admin_port=admin_port, delta=spec.mode == "delta"))
        # Envoy's admin answers as soon as it listens; the sync with the control plane is waited for after.
        return Component(name=ENVOY, argv=[spec.envoy_path, "-c", str(config), "--disable-hot-restart",
                                           "--concurrency", "1", "--log-level", "warning"],
                         ready_url=f"http://127.0.0.1:{admin_port}/server_info", log_path=self.envoy_log,
                         env=child_env(), ready_timeout_s=60.0)

    async def start(self, spec: Spec, xds_port: int, route_name: str) -> None:
        components = []
        if spec.fakes:
            components.append(self.fleet_component(spec, f"127.0.0.1:{xds_port}", route_name))
        if spec.envoy:
            components.append(self.envoy_component(spec, xds_port))
        await self.group.start(components)
        self.started = [c.name for c in components]

    def problem(self) -> str | None:
        """Why waiting further is pointless (a child died), else None."""
        try:
            self.group.check_alive()
        except ComponentDied as exc:
            log = self.envoy_log if str(exc).startswith(ENVOY) else self.fleet_log
            return f"{exc}: {log_tail(log)}"
        return None

    def cpu_seconds(self) -> dict[str, float]:
        out = {}
        for key, name in (("fleet", FLEET), ("envoy", ENVOY)):
            if name in self.started:
                with contextlib.suppress(psutil.Error, KeyError):
                    t = psutil.Process(self.group.pid(name)).cpu_times()
                    out[key] = t.user + t.system
        return out

    def lines(self) -> list[dict[str, Any]]:
        """The fleet's JSON lines (one per response a client received), once it has stopped."""
        out = []
        with contextlib.suppress(OSError):
            for raw in self.fleet_log.read_text(errors="replace").splitlines():
                if raw.startswith("{"):
                    with contextlib.suppress(ValueError):
                        line = json.loads(raw)
                        if isinstance(line, dict) and "type" in line:
                            out.append(line)
        return out
