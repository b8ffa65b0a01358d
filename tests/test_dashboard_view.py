"""The dashboard's pure view (``control_plane.admin.dashboard_view``) without a network, and the vendored
front-end library against its pinned hashes."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest

from control_plane.admin import dashboard_view as view
from control_plane.api_models import (
    ActivePolicy,
    AvailablePolicies,
    AvailablePolicy,
    EndpointList,
    EndpointOut,
    ModelCatalogueOut,
    ModelEndpointOut,
    ModelVersionOut,
    NackOut,
    PolicyState,
    TelemetryOut,
    TypeStatusOut,
    Weights,
    XdsClientOut,
    XdsClients,
)
from control_plane.admin.dashboard import STATIC_DIR, STATIC_FILES, sse_event
from control_plane.telemetry.parse import parse_families

A, B = "127.0.0.1:8101", "127.0.0.1:8102"


def ext_proc_metrics(picks_a: float, picks_b: float, served: float, shed: float = 0, failed: float = 0,
                     start: float = 1000.0, fast: float = 0, slow: float = 0, hits: float = 0,
                     misses: float = 0) -> str:
    """An ext_proc's /metrics text with the families the dashboard reads, written as prometheus_client writes
    them (a counter's TYPE line names it with _total)."""
    total = fast + slow
    return f"""\
# TYPE process_start_time_seconds gauge
process_start_time_seconds {start}
# TYPE inferlb_ext_proc_decisions_total counter
inferlb_ext_proc_decisions_total{{endpoint="{A}",policy="least_completion_time"}} {picks_a}
inferlb_ext_proc_decisions_total{{endpoint="{B}",policy="least_completion_time"}} {picks_b}
# TYPE inferlb_ext_proc_tenant_requests_total counter
inferlb_ext_proc_tenant_requests_total{{outcome="served",tenant="acme"}} {served}
inferlb_ext_proc_tenant_requests_total{{outcome="shed",tenant="acme"}} {shed}
inferlb_ext_proc_tenant_requests_total{{outcome="failed",tenant="anonymous"}} {failed}
inferlb_ext_proc_tenant_requests_total{{outcome="bogus",tenant="acme"}} 99
# TYPE inferlb_ext_proc_model_response_seconds histogram
inferlb_ext_proc_model_response_seconds_bucket{{le="0.01",model="m"}} {fast}
inferlb_ext_proc_model_response_seconds_bucket{{le="0.1",model="m"}} {total}
inferlb_ext_proc_model_response_seconds_bucket{{le="+Inf",model="m"}} {total}
inferlb_ext_proc_model_response_seconds_count{{model="m"}} {total}
inferlb_ext_proc_model_response_seconds_sum{{model="m"}} 1.0
# TYPE inferlb_ext_proc_cache_requests_total counter
inferlb_ext_proc_cache_requests_total{{level="local",result="hit"}} {hits}
inferlb_ext_proc_cache_requests_total{{level="local",result="miss"}} {misses}
"""


def counters(text: str) -> view.GatewayCounters:
    parsed = view.gateway_counters(parse_families(text))
    assert parsed is not None
    return parsed


def telemetry(rps: float, p99: float, error_rate: float = 0.0, stale: bool = False) -> TelemetryOut:
    return TelemetryOut(cpu_utilization=0.5, latency_mean_s=0.01, latency_p50_s=0.005, latency_p99_s=p99,
                        latency_per_token_s=0.001, queue_wait_mean_s=0.0, queue_depth=1.0, inflight=2.0, rps=rps,
                        tokens_per_s=rps * 10, error_rate=error_rate, slots=1.0, batch_cost_fixed_s=0.001,
                        batch_cost_per_token_s=0.0001, age_s=0.1, stale=stale)


def endpoint(endpoint_id: str, t: TelemetryOut | None, *, draining: bool = False, health: str = "healthy",
             pinned: int | None = None) -> EndpointOut:
    host, port = endpoint_id.rsplit(":", 1)
    return EndpointOut(id=endpoint_id, address=host, port=int(port), source="static", health=health,
                       draining=draining, removing=False, routable=not draining and health != "unhealthy",
                       weight=Weights(effective=pinned or 100, computed=100, pinned=pinned),
                       consecutive_scrape_failures=0, telemetry=t)


ENDPOINTS = EndpointList(endpoints=[endpoint(A, telemetry(10, 0.02, error_rate=0.1)), endpoint(B, telemetry(30, 0.05))])


# --- gateway counters and rates ----------------------------------------------------------------------------


def test_counters_are_read_from_ext_procs_families_and_unknown_outcomes_left_out() -> None:
    c = counters(ext_proc_metrics(5, 7, 12, shed=2, failed=1, fast=3, slow=1, hits=4, misses=6))
    assert c.started_at == 1000.0
    assert c.picks == {A: 5, B: 7}
    assert c.tenants == {("acme", "served"): 12, ("acme", "shed"): 2, ("anonymous", "failed"): 1}
    assert c.response_buckets == ((0.01, 3), (0.1, 4), (float("inf"), 4))
    assert c.cache == {("local", "hit"): 4, ("local", "miss"): 6}


def test_a_body_without_decisions_is_not_an_ext_proc() -> None:
    assert view.gateway_counters(parse_families("# TYPE x counter\nx_total 1\n")) is None


def test_labelled_series_are_capped_per_replica() -> None:
    lines = ["# TYPE inferlb_ext_proc_decisions_total counter"]
    lines += [f'inferlb_ext_proc_decisions_total{{endpoint="10.0.{i // 256}.{i % 256}:1",policy="p"}} 1'
              for i in range(view.MAX_KEYS + 10)]
    assert len(counters("\n".join(lines) + "\n").picks) == view.MAX_KEYS


def test_rates_are_increases_over_the_interval_summed_over_replicas() -> None:
    before = {"r1": counters(ext_proc_metrics(10, 20, 30, fast=0)),
              "r2": counters(ext_proc_metrics(0, 0, 0, start=2000.0))}
    after = {"r1": counters(ext_proc_metrics(14, 22, 36, shed=2, failed=1, fast=5, hits=3, misses=1)),
             "r2": counters(ext_proc_metrics(2, 0, 2, start=2000.0))}
    rates = view.gateway_rates(before, after, 2.0)
    assert rates is not None and rates.replicas == 2
    assert rates.picks == {A: 3.0, B: 1.0}  # (4 + 2) / 2 and 2 / 2
    assert rates.outcome("served") == 4.0 and rates.outcome("shed") == 1.0 and rates.outcome("failed") == 0.5
    assert rates.requests_per_s == 5.5
    assert rates.response_quantile(0.99) == pytest.approx(0.01 * 0.99)  # all five in the first bucket
    assert rates.cache == {("local", "hit"): 1.5, ("local", "miss"): 0.5}


def test_a_restarted_replica_sits_the_interval_out() -> None:
    before = {"r1": counters(ext_proc_metrics(100, 100, 200))}
    new_process = {"r1": counters(ext_proc_metrics(1, 1, 2, start=5000.0))}
    counter_down = {"r1": counters(ext_proc_metrics(1, 1, 2))}  # same start time, but counters went down
    assert view.gateway_rates(before, new_process, 1.0) is None
    assert view.gateway_rates(before, counter_down, 1.0) is None


def test_no_rates_without_two_reads_or_a_positive_interval() -> None:
    now = {"r1": counters(ext_proc_metrics(1, 1, 2))}
    assert view.gateway_rates({}, now, 1.0) is None
    assert view.gateway_rates(now, now, 0.0) is None


# --- points and history --------------------------------------------------------------------------------------


def test_a_point_takes_the_gateways_figures_when_it_has_them() -> None:
    rates = view.gateway_rates({"r": counters(ext_proc_metrics(0, 0, 0))},
                               {"r": counters(ext_proc_metrics(6, 2, 8, shed=1, failed=2, fast=8))}, 1.0)
    p = view.point(1, 100.0, ENDPOINTS, rates)
    assert p.picks_source == "gateway" and p.picks == {A: 6.0, B: 2.0}
    assert (p.requests_per_s, p.sheds_per_s, p.errors_per_s, p.rate_limited_per_s) == (11.0, 1.0, 2.0, 0.0)
    assert p.served_rps == 40 and p.worker_p99_s == 0.05
    assert p.p99_s is not None and p.p99_s <= 0.01


def test_without_a_gateway_a_point_falls_back_to_the_workers_and_says_so() -> None:
    p = view.point(1, 100.0, ENDPOINTS, None)
    assert p.picks_source == "workers" and p.picks == {A: 10, B: 30}
    assert p.errors_per_s == pytest.approx(1.0)  # 10% of endpoint A's 10/s
    assert p.sheds_per_s is None and p.requests_per_s is None and p.p99_s is None
    json = p.json()
    assert json["sheds_per_s"] is None and json["picks"] == {A: 10.0, B: 30.0}


def test_stale_telemetry_counts_as_unknown() -> None:
    endpoints = EndpointList(endpoints=[endpoint(A, telemetry(50, 0.5, stale=True)), endpoint(B, None)])
    p = view.point(1, 0.0, endpoints, None)
    assert p.served_rps == 0 and p.worker_p99_s is None


def test_history_keeps_the_newest_points_and_hands_out_what_a_page_lacks() -> None:
    h = view.History()
    for _ in range(5):
        h = h.add(view.point(h.next_seq, 0.0, ENDPOINTS, None), keep=3)
    assert [p.seq for p in h.points] == [3, 4, 5]
    assert [p.seq for p in h.since(3)] == [4, 5] and h.since(5) == ()


# --- the snapshot ------------------------------------------------------------------------------------------


def test_endpoint_state_names_the_most_important_condition() -> None:
    assert view.endpoint_state(endpoint(A, telemetry(1, 0.1))) == "healthy"
    assert view.endpoint_state(endpoint(A, telemetry(1, 0.1, stale=True))) == "stale"
    assert view.endpoint_state(endpoint(A, None, health="unhealthy")) == "unhealthy"
    assert view.endpoint_state(endpoint(A, None, health="unhealthy", draining=True)) == "draining"
    assert view.endpoint_state(endpoint(A, None, health="unknown")) == "unknown"


def test_tenants_busiest_first_and_the_rest_summed() -> None:
    tenants = {(f"t{i:03d}", "served"): float(i) for i in range(view.MAX_TENANTS_SHOWN + 5)}
    rows = view.tenant_rows(view.GatewayRates(replicas=1, tenants=tenants))
    assert len(rows) == view.MAX_TENANTS_SHOWN + 1
    assert rows[0]["tenant"] == f"t{view.MAX_TENANTS_SHOWN + 4:03d}"
    assert rows[-1] == {"tenant": "(others)", "served": 0 + 1 + 2 + 3 + 4, "failed": 0.0, "rate_limited": 0.0,
                        "shed": 0.0, "unauthenticated": 0.0}


def test_snapshot_brings_every_section_together() -> None:
    nack = NackOut(version="v1", nonce="n", message="bad cluster", at=1.0)
    xds = XdsClients(clients=[XdsClientOut(
        stream_id=1, node_id="envoy-1", node_cluster="inferlb", group="inferlb", mode="sotw", connected_at=1.0,
        types={"eds": TypeStatusOut(type_url="t", wildcard=True, names=[], sent_version="v2", acked_version="v1",
                                    current_version="v2", in_sync=False, push_count=2, nack_count=1,
                                    last_nack=nack)})])
    policy = PolicyState(weight=ActivePolicy(name="capacity", params={}),
                         pick=ActivePolicy(name="least_completion_time", params={}),
                         available=AvailablePolicies(weight=[AvailablePolicy(name="capacity", summary="",
                                                                             params_schema={})], pick=[]))
    models = ModelCatalogueOut(models=[ModelVersionOut(id="m-int8", aliases=["m"], routable=True, endpoints=[
        ModelEndpointOut(id=A, routable=True, pool="fast")])], rollouts=[])
    rates = view.gateway_rates({"r": counters(ext_proc_metrics(0, 0, 0))},
                               {"r": counters(ext_proc_metrics(1, 1, 2, hits=3, misses=1))}, 1.0)
    snap = view.snapshot(view.Sources(endpoints=ENDPOINTS, xds=xds, policy=policy, models=models, models_error=None,
                                      rates=rates, gateway=view.GatewayStatus(replicas=2, read=1,
                                                                              errors={"r2": "HTTP 500"})),
                         at=12.0, interval_s=1.0, viewers=3)
    assert [(e["id"], e["pool"], e["state"]) for e in snap["endpoints"]] == [(A, "fast", "healthy"),
                                                                           (B, None, "healthy")]
    assert snap["xds_clients"][0]["types"]["eds"] == {"acked": "v1", "current": "v2", "in_sync": False, "nacks": 1,
                                                      "last_nack": nack.model_dump(mode="json")}
    assert snap["policy"]["available"] == {"weight": ["capacity"], "pick": []}
    assert snap["cache"] == [{"level": "local", "hit": 3.0, "miss": 1.0, "hit_ratio": 0.75}]
    assert snap["gateway"] == {"replicas": 2, "read": 1, "errors": {"r2": "HTTP 500"}, "counted": 1}
    assert snap["viewers"] == 3 and snap["models"]["models"][0]["id"] == "m-int8"


def test_an_sse_event_is_one_data_line() -> None:
    event = sse_event("snapshot", {"text": "two\nlines"})
    assert event.endswith(b"\n\n") and event.count(b"\n") == 3
    assert event.startswith(b"event: snapshot\ndata: {")


# --- the vendored library --------------------------------------------------------------------------------


def test_vendored_files_match_their_pinned_hashes() -> None:
    vendor = STATIC_DIR / "vendor"
    sums = {}
    for line in (vendor / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    assert set(sums) == {"uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"}
    for name, digest in sums.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    assert (vendor / "uPlot.iife.min.js").read_text().startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")


def test_the_page_loads_the_library_with_matching_integrity_attributes() -> None:
    html = (STATIC_DIR / "index.html").read_text()
    tags = dict(re.findall(r'(?:src|href)="/dashboard/static/(vendor/[^"]+)"\s+integrity="([^"]+)"', html))
    assert set(tags) == {"vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"}
    for name, integrity in tags.items():
        digest = base64.b64encode(hashlib.sha384((STATIC_DIR / name).read_bytes()).digest()).decode()
        assert integrity == f"sha384-{digest}", name


def test_every_served_file_exists_and_the_page_has_no_inline_script_or_style() -> None:
    for name in STATIC_FILES:
        assert (STATIC_DIR / name).is_file(), name
    html = (STATIC_DIR / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "an inline script would need 'unsafe-inline'"
    assert "<style" not in html and " style=" not in html and " on" not in re.sub(r'"[^"]*"', '""', html)
    assert Path(STATIC_DIR / "dashboard.js").read_text().count("eval(") == 0
