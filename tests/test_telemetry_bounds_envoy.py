"""One bad /metrics cannot freeze the fleet: real ``python -m control_plane``, real Envoy, simulated workers.

A third "worker" is a test server whose /metrics misbehaves: it drips its body
a byte at a time (a wedged exporter), or it reports NaN. The control plane's
scrape rounds must keep going for the good workers and keep publishing to
Envoy, and a NaN must never reach a weight.
"""

from __future__ import annotations

import math
import re
import threading
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from .stack import ControlPlane, Envoy, Proc, running_control_plane, running_envoy, running_sim_workers, sample, \
    wait_for
from .test_telemetry import FakeWorkerMetrics

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


class BadMetricsServer:
    """A worker whose /metrics drips (``mode="drip"``: one byte per 50 ms, never done within the test) or
    reports NaN (``mode="nan"``); ``/healthz`` and ``/readyz`` answer 200. Runs in threads; always stopped."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stop = threading.Event()
        self.drips_started = 0
        self.drips_finished = 0
        self.metrics = FakeWorkerMetrics()
        self.metrics.request(tokens=10)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/metrics":
                    self.send_response(200)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                    return
                server.metrics.request(tokens=10)
                body = server.metrics.text().encode()
                if server.mode == "nan":
                    body = re.sub(rb"(?m)^inferlb_worker_tokens_total .*$", b"inferlb_worker_tokens_total NaN", body)
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                if server.mode != "drip":
                    self.wfile.write(body)
                    return
                server.drips_started += 1
                try:
                    for byte in body:
                        if server.stop.wait(0.05):  # the server's own pace, not a test's synchronisation
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    server.drips_finished += 1
                except OSError:
                    pass  # the scraper hung up at its deadline

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.id = f"127.0.0.1:{self.port}"

    @contextmanager
    def running(self) -> Iterator["BadMetricsServer"]:
        thread = threading.Thread(target=self.httpd.serve_forever, name=f"bad-metrics-{self.port}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            self.httpd.shutdown()
            self.httpd.server_close()
            thread.join(10)


def ok_scrapes(cp: ControlPlane, endpoint: str) -> float:
    return sample(cp.metrics(), "inferlb_cp_scrapes_total", endpoint=endpoint, result="ok") or 0.0


@contextmanager
def fleet_with(tmp_path: Path, bad: BadMetricsServer, **cp_env: str
               ) -> Iterator[tuple[ControlPlane, Envoy, set[str], list[Proc]]]:
    with ExitStack() as exits:
        exits.enter_context(bad.running())
        workers = exits.enter_context(running_sim_workers(tmp_path, 2))
        good = {w.id for w in workers}
        cp = exits.enter_context(running_control_plane(tmp_path, endpoints=sorted(good | {bad.id}), env=cp_env))
        envoy = exits.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-bad-metrics"))
        yield cp, envoy, good, [cp.proc, envoy.proc, *(w.proc for w in workers)]


def test_a_dripping_metrics_never_holds_back_the_other_endpoints(tmp_path: Path) -> None:
    """Before: a round awaited every scrape, and a drip trips no per-read timeout, so one wedged exporter
    stopped every endpoint's telemetry (and the weights built on it) for as long as it dripped."""
    bad = BadMetricsServer("drip")
    # A total deadline far longer than the test: the drip is still in progress throughout.
    with fleet_with(tmp_path, bad, INFERLB_CP_SCRAPE_TIMEOUT_S="120") as (cp, envoy, good, procs):
        wait_for(lambda: bad.drips_started >= 1, 30, "the control plane to start scraping the dripping worker",
                 procs)
        start = {e: ok_scrapes(cp, e) for e in good}
        # Ten more rounds for each good worker (0.25 s apart) while the one drip has not finished.
        wait_for(lambda: all(ok_scrapes(cp, e) >= start[e] + 10 for e in good), 60,
                 lambda: f"ten more scrapes of each good worker; at {({e: ok_scrapes(cp, e) for e in good})}",
                 procs)
        assert bad.drips_finished == 0 and bad.drips_started == 1  # never scraped twice at once
        # Envoy is still served: both good workers are healthy there and carry a weight.
        wait_for(lambda: good <= envoy.healthy_hosts(), 30, "Envoy to see the good workers healthy", procs)
        assert all(envoy.weights()[e] > 0 for e in good)


def test_a_nan_in_a_worker_metrics_never_reaches_a_weight(tmp_path: Path) -> None:
    """Before: a NaN counter entered the moving average for good and the weights built on it."""
    bad = BadMetricsServer("nan")
    with fleet_with(tmp_path, bad, INFERLB_CP_WEIGHT_POLICY="capacity") as (cp, envoy, good, procs):
        wait_for(lambda: (sample(cp.metrics(), "inferlb_cp_scrape_refused_samples_total") or 0) >= 3, 30,
                 "the control plane to refuse NaN samples from three scrapes", procs)
        weights = {dict(labels)["endpoint"]: value for (name, labels), value in cp.metrics().items()
                   if name == "inferlb_cp_endpoint_weight"}
        assert weights and all(math.isfinite(v) for v in weights.values()), weights
        # Envoy takes every EDS the control plane sends (a NaN weight would be NACKed and freeze it).
        wait_for(lambda: set(envoy.weights()) == good | {bad.id}, 30, "Envoy to carry all three endpoints", procs)
        assert all(w > 0 for w in envoy.weights().values())
