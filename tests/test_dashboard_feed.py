"""The dashboard's routes on a real ``python -m control_plane`` (one simulated worker): the page and its
static files with their headers, the SSE feed's life (a client that leaves, a shutdown) and who may read it.
Every wait is on a condition with a deadline (an event arrives about once a second)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control_plane.admin.dashboard import STATIC_DIR

from .stack import ControlPlane, http, running_control_plane, running_sim_workers
from .test_admin_api import assert_error

pytestmark = [pytest.mark.slow, pytest.mark.servers]

DEADLINE_S = 30.0


def events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """(event, data) of each ``text/event-stream`` event, as they arrive; ends with the stream."""
    name, data = "message", []
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif line == "" and data:
            yield name, json.loads("\n".join(data))
            name, data = "message", []


def stream(client: httpx.Client, cp: ControlPlane, headers: dict[str, str] | None = None):
    return client.stream("GET", f"{cp.admin_url}/dashboard/events", headers=headers, timeout=10)


def next_snapshot(it: Iterator[tuple[str, dict]]) -> dict:
    for name, data in it:
        if name == "snapshot":
            return data
    raise AssertionError("the stream ended before a snapshot")


def test_page_static_files_and_headers(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[worker.id]) as cp, http() as client:
        page = client.get(f"{cp.admin_url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe" not in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        library = client.get(f"{cp.admin_url}/dashboard/static/vendor/uPlot.iife.min.js")
        assert library.status_code == 200 and library.headers["content-type"].startswith("text/javascript")
        assert library.content == (STATIC_DIR / "vendor/uPlot.iife.min.js").read_bytes()
        for name in ("nope.js", "../admin.py", "..%2Fadmin.py", "vendor/SHA256SUMS"):
            assert_error(client.get(f"{cp.admin_url}/dashboard/static/{name}"), 404)
        schema = client.get(f"{cp.admin_url}/openapi.json").json()
        assert not [p for p in schema["paths"] if p.startswith("/dashboard")], "an endless stream is no API operation"

        snapshot = client.get(f"{cp.admin_url}/dashboard/api/snapshot").json()
        assert [e["id"] for e in snapshot["endpoints"]] == [worker.id]
        assert snapshot["gateway"]["replicas"] == 0 and snapshot["points"][-1]["picks_source"] == "workers"


def test_a_stream_ends_when_its_client_leaves_and_all_end_at_shutdown(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 1) as (worker,), running_control_plane(tmp_path, endpoints=[worker.id]) as cp:
        with http() as first_client, http() as second_client:
            with stream(second_client, cp) as second:
                assert second.headers["content-type"].startswith("text/event-stream")
                later = events(second)
                assert next_snapshot(later)["viewers"] == 1
                with stream(first_client, cp) as first:
                    first_snapshot = next_snapshot(events(first))
                    assert first_snapshot["viewers"] == 2
                    assert first_snapshot["points"], "a new page gets the history first"
                # The first client left: the server ends its stream, and the count says so.
                deadline = time.monotonic() + DEADLINE_S
                while next_snapshot(later)["viewers"] != 1:
                    assert time.monotonic() < deadline, "the left stream still counted"

                # SIGTERM: the open stream ends (cleanly, with the last event complete), the process exits 0.
                cp.proc.process.send_signal(signal.SIGTERM)
                rest = list(later)
                assert all(name == "snapshot" for name, _ in rest)
        assert cp.proc.process.wait(DEADLINE_S) == 0
        assert '"reason": "shutdown"' in cp.proc.log()


def test_the_feed_is_a_read_the_token_guards_when_reads_need_it(tmp_path: Path) -> None:
    secret = "dashboard-test-token-0123456789abcdef"
    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[worker.id],
                                  env={"INFERLB_ADMIN_TOKEN": secret, "INFERLB_CP_ADMIN_AUTH_READS": "true"}) as cp, \
            http() as client:
        assert client.get(f"{cp.admin_url}/dashboard").status_code == 200  # the page: to type the token in
        assert_error(client.get(f"{cp.admin_url}/dashboard/api/snapshot"), 401, "unauthorized")
        with stream(client, cp) as refused:
            refused.read()
            assert_error(refused, 401, "unauthorized")
        with stream(client, cp, {"authorization": f"Bearer {secret}"}) as allowed:
            assert next_snapshot(events(allowed))["endpoints"][0]["id"] == worker.id
