"""``python -m inferlb.bench.reliability.faults_nacking_control_plane ...``: the real control plane, made to send Envoy a
config it NACKs, on demand (the ``nack`` fault of ``inferlb bench faults``).

The admin API refuses every endpoint Envoy could not take (addresses are checked as IPs), so nothing a client
sends makes Envoy NACK today; the fault is injected: while the file named by ``INFERLB_FAULTS_NACK_FLAG``
exists, the Envoys' snapshot gets one more endpoint, ``not-an-ip:1234``, whose ClusterLoadAssignment Envoy
rejects ("malformed IP address"). ext_proc's snapshot is built from the real state and is unaffected.
Everything else (publishing, xDS, the admin API and ``/v1/xds/clients``, the store) is the real process with
its real command line.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from control_plane import controller
from control_plane.__main__ import main
from control_plane.model import Endpoint, FleetState

FLAG_ENV = "INFERLB_FAULTS_NACK_FLAG"
BAD_ENDPOINT = Endpoint(address="not-an-ip", port=1234, source="static")


def inject(flag: Path) -> None:
    """Wrap the controller's snapshot builder: with ``flag`` present, the state it builds from has
    ``BAD_ENDPOINT`` too."""
    build = controller.build_snapshot

    def build_snapshot(state: FleetState, *args: Any, **kwargs: Any) -> Any:
        if flag.exists():
            state = dataclasses.replace(state, endpoints=(*state.endpoints, BAD_ENDPOINT))
        return build(state, *args, **kwargs)

    controller.build_snapshot = build_snapshot  # type: ignore[assignment]


if __name__ == "__main__":
    inject(Path(os.environ[FLAG_ENV]))
    raise SystemExit(main())
