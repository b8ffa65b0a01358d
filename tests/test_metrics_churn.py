"""Endpoint label sets are pruned when an endpoint leaves: churn never grows /metrics.

Real ``python -m control_plane``, ``python -m ext_proc``, Envoy and simulated
workers. Every worker serves traffic, so each has series in both services
(scrapes, weights and health in the control plane; picks, outstanding work
and prediction error in ext_proc). Removing one through the admin API must
remove every series labelled with it, while the others keep theirs.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from urllib.parse import quote

import pytest

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

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def labelled(samples: dict[tuple[str, frozenset], float]) -> dict[str, set[str]]:
    """endpoint label value -> the metric names that carry it."""
    found: dict[str, set[str]] = {}
    for name, labels in samples:
        endpoint = dict(labels).get("endpoint")
        if endpoint is not None:
            found.setdefault(endpoint, set()).add(name)
    return found


def test_an_endpoint_that_leaves_takes_its_series_with_it(tmp_path: Path) -> None:
    ext_proc_port = free_port()
    with ExitStack() as exits:
        workers = exits.enter_context(running_sim_workers(tmp_path, 3, speed=20.0))
        ids = {w.id for w in workers}
        gone = workers[0]  # added through the admin API (a static endpoint cannot be removed), then removed
        cp = exits.enter_context(running_control_plane(tmp_path, endpoints=sorted(ids - {gone.id}),
                                                       ext_proc_port=ext_proc_port))
        auth = {"authorization": f"Bearer {cp.admin_token()}"}
        with http() as client:
            response = client.post(f"{cp.admin_url}/v1/endpoints", headers=auth,
                                   json={"address": "127.0.0.1", "port": gone.port})
        assert response.status_code == 201, response.text
        ext_proc = exits.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port))
        envoy = exits.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-churn"))
        procs = [cp.proc, ext_proc.proc, envoy.proc, *(w.proc for w in workers)]
        wait_for(lambda: envoy.healthy_hosts() == ids, 30, "Envoy to see every worker healthy", procs)
        wait_for(lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_routable_endpoints") == 3, 30,
                 "ext_proc to see every worker routable", procs)

        def every_worker_picked() -> bool:
            with http() as client:
                for i in range(6):
                    response = client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings",
                                           json={"input": f"churn {i}"})
                    assert response.status_code == 200, response.text
            picks = {dict(labels)["endpoint"] for name, labels in ext_proc.metrics()
                     if name == "inferlb_ext_proc_decisions_total"}
            return picks >= ids

        wait_for(every_worker_picked, 60, "ext_proc to pick every worker", procs)
        assert set(labelled(cp.metrics())) >= ids

        with http() as client:
            response = client.delete(f"{cp.admin_url}/v1/endpoints/{quote(gone.id, safe='')}", headers=auth)
        assert response.status_code == 202, response.text

        def series_left() -> dict[str, set[str]]:
            return {"control plane": labelled(cp.metrics()).get(gone.id, set()),
                    "ext_proc": labelled(ext_proc.metrics()).get(gone.id, set())}

        wait_for(lambda: not any(series_left().values()), 60,
                 lambda: f"{gone.id}'s series to leave /metrics; left: {series_left()}", procs)
        # The others keep theirs.
        assert set(labelled(cp.metrics())) >= ids - {gone.id}
        assert set(labelled(ext_proc.metrics())) >= ids - {gone.id}
