"""Fair admission through the real wire: a request that waits its turn in ext_proc is routed by ext_proc.

A request queued in ext_proc's fair admission queue is answered only when its turn comes, which is
longer than Envoy's ext_proc message timeout (200 ms). ext_proc first tells Envoy to wait
(override_message_timeout, up to the filter's max_message_timeout): without that, Envoy would give up at
200 ms and fail open, sending the request without ext_proc's pick. The fleet is one simulated worker,
slowed so that the first request holds it for seconds; ext_proc's depth is one request per endpoint.
The order among tenants is tested in process (tests/test_ext_proc_tenants.py); this is the wire.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from .stack import http, running_gateway, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

MESSAGE_TIMEOUT_S = 0.2  # the control plane's default ext_proc_message_timeout_ms


def test_a_queued_request_waits_past_envoys_message_timeout_and_is_routed_by_ext_proc(tmp_path: Path) -> None:
    with running_gateway(tmp_path, name="fair", ext_proc_env={"INFERLB_EXT_PROC_FAIR_QUEUE_DEPTH": "1",
                                                                 "INFERLB_EXT_PROC_ADMISSION_ROOM": "requests"}) as gw:
        ext_proc, envoy, procs, worker, url = gw.ext_proc, gw.envoy, gw.procs, gw.workers[0], gw.url()

        def post(text: str) -> httpx.Response:
            with http() as client:
                return client.post(url, json={"input": text}, timeout=60)

        wait_for(lambda: post("warm up").headers.get("x-inferlb-endpoint") == worker.id, 30,
                 "ext_proc to route", procs)
        worker.set_speed(0.01)  # a 200-token input now holds the worker for about 2.4 s
        first: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: first.append(post("tokens " * 200)))
        holder.start()
        try:
            in_flight = lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_outstanding_requests",  # noqa: E731
                                       endpoint=worker.id) == 1
            wait_for(in_flight, 30, "the first request to hold the worker", procs)
            second = post("a short sentence")  # waits in ext_proc's queue until the first is answered
        finally:
            holder.join(60)
        assert first and first[0].status_code == 200, first
        assert second.status_code == 200, second.text
        assert second.headers.get("x-inferlb-endpoint") == worker.id  # ext_proc's pick: Envoy waited for it
        metrics = ext_proc.metrics()
        assert sample(metrics, "inferlb_ext_proc_fair_queue_wait_seconds_count", how="admitted") == 1
        # The wait really was past Envoy's message timeout (else this test would prove nothing).
        assert sample(metrics, "inferlb_ext_proc_fair_queue_wait_seconds_sum", how="admitted") > MESSAGE_TIMEOUT_S
        assert envoy.stat("http.inferlb_http.ext_proc.message_timeouts") in (0, None)
