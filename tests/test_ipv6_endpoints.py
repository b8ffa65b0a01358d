"""IPv6 workers through the real data path: ``::1`` endpoints, Envoy, ``python -m control_plane`` and ext_proc.

EDS names an IPv6 endpoint ``::1:port``; Envoy reports the host that answered
as the ``upstream.address`` attribute in URL form, ``[::1]:port``. ext_proc
must map one to the other, else it learns nothing from an IPv6 worker's
responses (its cost model and load reports are keyed by the EDS id) and
labels the answer with an endpoint its fleet view does not have.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

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

ENDPOINT_HEADER = "x-inferlb-endpoint"


def test_ext_proc_learns_from_ipv6_workers_under_their_eds_ids(tmp_path: Path) -> None:
    ext_proc_port = free_port()
    with ExitStack() as exits:
        workers = exits.enter_context(running_sim_workers(tmp_path, 2, host="::1"))
        ids = {w.id for w in workers}
        assert all(i.startswith("::1:") for i in ids)
        cp = exits.enter_context(running_control_plane(tmp_path, endpoints=sorted(ids), ext_proc_port=ext_proc_port))
        ext_proc = exits.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port))
        envoy = exits.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-ipv6"))
        procs = [cp.proc, ext_proc.proc, envoy.proc, *(w.proc for w in workers)]
        wait_for(lambda: len(envoy.healthy_hosts()) == 2, 30, "Envoy to see both IPv6 workers healthy", procs)
        wait_for(lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_routable_endpoints") == 2, 30,
                 "ext_proc to see both IPv6 workers routable", procs)

        answered: set[str] = set()
        with http() as client:
            for i in range(20):
                response = client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings",
                                       json={"input": f"ipv6 request {i}"})
                assert response.status_code == 200, response.text
                answered.add(response.headers[ENDPOINT_HEADER])

        # The answering host, as ext_proc reports it, is an EDS id (not Envoy's bracketed form) ...
        assert answered and answered <= ids, answered
        metrics = ext_proc.metrics()
        # ... and each response taught the cost model about that endpoint.
        assert (sample(metrics, "inferlb_ext_proc_cost_observations") or 0) > 0
        learnt = {dict(labels)["endpoint"] for (name, labels) in metrics
                  if name == "inferlb_ext_proc_endpoint_prediction_mape"}
        assert learnt and learnt <= ids, learnt

