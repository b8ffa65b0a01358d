"""The bench's data planes, capacity search and table: pure renderers and math, checked by the real binaries.

The rendered Envoy bootstraps go through ``envoy --mode validate`` and the
nginx config through ``nginx -t``; no load is run here (tests/test_bench_run.py does).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from inferlb.bench.routing.capacity import (
    Probe,
    capacity_from_probes,
    mean_tokens,
    next_probe_rps,
    theoretical_capacity_rps,
)
from inferlb.bench.stack.dataplanes import DataPlanePorts, plan_data_plane
from inferlb.bench.stack.dataplanes.envoy_static import CSWRR_SETTINGS, POLICIES, lb_policy, render_static_bootstrap
from inferlb.bench.stack.dataplanes.launch import healthy_hosts, pick_decisions
from inferlb.bench.stack.dataplanes.nginx import nginx_argv, prepare_prefix, render_nginx_conf
from inferlb.bench.stack.fleet import FleetLayout, outstanding, worker_argv
from inferlb.bench.report.results import RunResult
from inferlb.bench.routing.runner import PROBE_DURATION_S, plan_configurations, probe_duration_s
from inferlb.bench.load.scenario import Fleet, Scenario, WorkerSpec, load_scenario
from inferlb.bench.report.table import render_markdown, spread_by_speed, target_ratios

from .stack import envoy_binary

ENDPOINTS = [("127.0.0.1", 18101), ("127.0.0.1", 18102), ("127.0.0.1", 18103)]
PORTS = DataPlanePorts(20001, 20002, 20003, 20004, 20005, 20006)

ROOT = Path(__file__).resolve().parent.parent


# --- Envoy baselines -----------------------------------------------------------------------------

def _cluster(doc: dict) -> dict:
    (cluster,) = doc["static_resources"]["clusters"]
    return cluster


@pytest.mark.parametrize("configuration,policy,type_suffix", [
    ("envoy_round_robin", "envoy.load_balancing_policies.round_robin", "round_robin.v3.RoundRobin"),
    ("envoy_least_request", "envoy.load_balancing_policies.least_request", "least_request.v3.LeastRequest"),
    ("envoy_cswrr_orca", "envoy.load_balancing_policies.client_side_weighted_round_robin",
     "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"),
])
def test_static_bootstrap_policy_and_fleet(configuration: str, policy: str, type_suffix: str) -> None:
    doc = render_static_bootstrap(configuration, endpoints=ENDPOINTS, listener_port=20001, admin_port=20002,
                                  request_timeout_s=7.5)
    cluster = _cluster(doc)
    (entry,) = cluster["load_balancing_policy"]["policies"]
    extension = entry["typed_extension_config"]
    assert extension["name"] == policy
    assert extension["typed_config"]["@type"].endswith(type_suffix)
    assert cluster["type"] == "STATIC"
    addresses = [(e["endpoint"]["address"]["socket_address"]["address"],
                  e["endpoint"]["address"]["socket_address"]["port_value"])
                 for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == ENDPOINTS  # the same order as the fleet
    (listener,) = doc["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 20001}
    assert doc["admin"]["address"]["socket_address"]["port_value"] == 20002
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"] == {"cluster": "workers", "timeout": "7.500s"}  # no retry_policy: no retries
    assert manager["request_timeout"] == manager["stream_idle_timeout"] == "7.500s"
    # inferlb's own Envoy has the same limits; Envoy's default 1024 pending would fail requests earlier.
    assert cluster["circuit_breakers"]["thresholds"][0]["max_pending_requests"] == 4096


def test_least_request_is_power_of_two_and_cswrr_has_short_periods() -> None:
    assert lb_policy("envoy_least_request")["policies"][0]["typed_extension_config"]["typed_config"][
        "choice_count"] == 2
    cswrr = lb_policy("envoy_cswrr_orca")["policies"][0]["typed_extension_config"]["typed_config"]
    assert cswrr["blackout_period"] == "1s" and cswrr["weight_update_period"] == "0.5s"
    assert "enable_oob_load_report" not in cswrr  # per-request ORCA headers only
    assert {k: cswrr[k] for k in CSWRR_SETTINGS} == dict(CSWRR_SETTINGS)


def test_static_bootstrap_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="not an Envoy baseline"):
        lb_policy("nginx_least_conn")
    with pytest.raises(ValueError, match="at least one endpoint"):
        render_static_bootstrap("envoy_round_robin", endpoints=[], listener_port=1, admin_port=2,
                                request_timeout_s=1)


@pytest.mark.envoy
@pytest.mark.parametrize("configuration", sorted(POLICIES))
def test_static_bootstrap_validates_with_the_real_envoy(configuration: str, tmp_path: Path) -> None:
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps(render_static_bootstrap(configuration, endpoints=ENDPOINTS, listener_port=20001,
                                                       admin_port=20002, request_timeout_s=10)))
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout + done.stderr


# --- nginx ---------------------------------------------------------------------------------------

def test_nginx_conf_least_conn_keepalive_and_prefix_paths(tmp_path: Path) -> None:
    text = render_nginx_conf(endpoints=ENDPOINTS, listen_port=20001, prefix=tmp_path, request_timeout_s=9,
                             keepalive=32, run_as_root=True)
    upstream = text[text.index("upstream workers {"):text.index("}", text.index("upstream workers {"))]
    assert "least_conn;" in upstream
    assert [line.strip() for line in upstream.splitlines() if line.strip().startswith("server ")] == [
        "server 127.0.0.1:18101;", "server 127.0.0.1:18102;", "server 127.0.0.1:18103;"]
    assert "keepalive 32;" in upstream
    for directive in ("proxy_http_version 1.1;", 'proxy_set_header Connection "";', "proxy_next_upstream off;",
                      "proxy_read_timeout 9s;", "listen 127.0.0.1:20001;", "daemon off;", "user root;"):
        assert directive in text
    assert f"pid {tmp_path.resolve() / 'nginx.pid'};" in text
    assert "user " not in render_nginx_conf(endpoints=ENDPOINTS, listen_port=1, prefix=tmp_path,
                                            request_timeout_s=1, run_as_root=False)


def test_nginx_conf_refuses_nonsense(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one upstream"):
        render_nginx_conf(endpoints=[], listen_port=1, prefix=tmp_path, request_timeout_s=1)
    with pytest.raises(ValueError, match="keepalive"):
        render_nginx_conf(endpoints=ENDPOINTS, listen_port=1, prefix=tmp_path, request_timeout_s=1, keepalive=0)


@pytest.mark.nginx
def test_nginx_conf_passes_nginx_t(tmp_path: Path) -> None:
    prefix = tmp_path / "nginx"
    prepare_prefix(prefix)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(endpoints=ENDPOINTS, listen_port=20001, prefix=prefix, request_timeout_s=10))
    done = subprocess.run(nginx_argv(conf, prefix, test=True), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr
    broken = conf.read_text().replace("least_conn;", "least_conn")
    conf.write_text(broken)
    assert subprocess.run(nginx_argv(conf, prefix, test=True), capture_output=True, timeout=30).returncode != 0


# --- plans ---------------------------------------------------------------------------------------

def _plan(configuration: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    return plan_data_plane(configuration, endpoints=ENDPOINTS, workdir=tmp_path, ports=PORTS, request_timeout_s=10,
                           envoy="/bin/envoy", python="/bin/python", nginx="/bin/nginx", admin_token="t0k")


def test_plan_of_an_envoy_baseline(tmp_path: Path) -> None:
    plan = _plan("envoy_cswrr_orca", tmp_path)
    (stage,) = plan.stages
    (envoy,) = stage
    assert envoy.argv[0] == "/bin/envoy" and "--disable-hot-restart" in envoy.argv
    assert envoy.argv[envoy.argv.index("--concurrency") + 1] == "1"
    assert envoy.ready_url == "http://127.0.0.1:20002/ready"
    assert plan.url == "http://127.0.0.1:20001/v1/embeddings"
    (text,) = plan.files.values()
    assert json.loads(text)["static_resources"]["clusters"][0]["load_balancing_policy"] == lb_policy(
        "envoy_cswrr_orca")


def test_plan_of_nginx_checks_its_config_first(tmp_path: Path) -> None:
    plan = _plan("nginx_least_conn", tmp_path)
    assert plan.check_argv[0] == "/bin/nginx" and plan.check_argv[-1] == "-t"
    (stage,) = plan.stages
    assert stage[0].ready_url == "http://127.0.0.1:20001/readyz"  # answered through nginx by a worker
    assert tmp_path / "nginx" / "temp" / "proxy" in plan.directories


def test_plan_of_inferlb_weights_disables_ext_proc(tmp_path: Path) -> None:
    plan = _plan("inferlb_weights", tmp_path)
    assert [[c.name for c in stage] for stage in plan.stages] == [["control-plane"], ["envoy"]]
    env = plan.stages[0][0].env
    assert env["INFERLB_CP_DATA_PLANE__EXT_PROC_ENABLED"] == "false"
    assert env["INFERLB_CP_DATA_PLANE__RETRIES"] == "0"
    assert env["INFERLB_CP_DATA_PLANE__LISTENER_PORT"] == "20001"
    argv = plan.stages[0][0].argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--endpoint"] == [f"{h}:{p}" for h, p in ENDPOINTS]
    assert plan.ext_proc_metrics_url is None and plan.pick_policy is None


def test_plan_of_inferlb_with_a_pick_policy(tmp_path: Path) -> None:
    plan = _plan("inferlb_pick:round_robin", tmp_path)
    assert [[c.name for c in stage] for stage in plan.stages] == [["control-plane"], ["ext_proc", "envoy"]]
    assert plan.stages[0][0].env["INFERLB_CP_DATA_PLANE__EXT_PROC_ENABLED"] == "true"
    assert plan.stages[0][0].env["INFERLB_ADMIN_TOKEN"] == plan.admin_token == "t0k"
    ext_proc = plan.stages[1][0]
    assert ext_proc.argv[ext_proc.argv.index("--pick-policy") + 1] == "round_robin"
    assert ext_proc.argv[ext_proc.argv.index("--xds-port") + 1] == "20003"
    assert plan.pick_policy == "round_robin"
    assert _plan("inferlb_ext_proc", tmp_path).pick_policy is None


def test_plan_refuses_an_unknown_configuration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown configuration 'haproxy'"):
        _plan("haproxy", tmp_path)


def test_children_do_not_inherit_inferlb_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERLB_CP_DATA_PLANE__RETRIES", "5")
    plan = _plan("inferlb_ext_proc", tmp_path)
    assert plan.stages[0][0].env["INFERLB_CP_DATA_PLANE__RETRIES"] == "0"
    assert "INFERLB_CP_DATA_PLANE__RETRIES" not in plan.stages[1][0].env


def test_worker_argv_carries_the_scenario_fleet() -> None:
    fleet = Fleet(workers=(WorkerSpec(1.0), WorkerSpec(0.25, slots=3)), cost_scale=4.0)
    argv = worker_argv(fleet, 1, 18102, python="py")
    flags = dict(zip(argv, argv[1:]))
    assert flags["--speed"] == "0.25" and flags["--sim-slots"] == "3" and flags["--sim-cost-scale"] == "4"
    assert flags["--port"] == "18102" and "--simulate" in argv
    assert float(flags["--sim-per-token-us"]) == pytest.approx(fleet.per_token_s * 1e6)
    assert FleetLayout((1, 2)).ids == ("127.0.0.1:1", "127.0.0.1:2")


# --- what the runner reads back ------------------------------------------------------------------

def test_healthy_hosts_from_envoy_clusters() -> None:
    text = ("workers::127.0.0.1:1::health_flags::healthy\nworkers::127.0.0.1:2::health_flags::/failed_active_hc\n"
            "workers::127.0.0.1:2::cx_active::0\nother::127.0.0.1:3::health_flags::healthy\n")
    assert healthy_hosts(text) == {"127.0.0.1:1"}


def test_pick_decisions_and_worker_outstanding_from_prometheus_text() -> None:
    text = ('# TYPE inferlb_ext_proc_decisions counter\n'
            'inferlb_ext_proc_decisions_total{policy="round_robin",endpoint="a"} 3\n'
            'inferlb_ext_proc_decisions_total{policy="round_robin",endpoint="b"} 4\n')
    assert pick_decisions(text) == {"round_robin": 7}
    worker = ("# TYPE inferlb_worker_inflight_requests gauge\ninferlb_worker_inflight_requests 2\n"
              "# TYPE inferlb_worker_queue_depth gauge\ninferlb_worker_queue_depth 1\n")
    assert outstanding(worker) == 3
    assert outstanding(worker.replace(" 2\n", " 0\n").replace(" 1\n", " 0\n")) == 0


def test_plan_configurations_adds_slowdown_and_pick_policies() -> None:
    s = Scenario(loads=(0.5, 0.8))
    plans = plan_configurations(s, pick_policies=("round_robin", "p2c_tokens"))
    by_name = {p.configuration: [(r.load, r.run) for r in p.runs] for p in plans}
    assert list(by_name)[:6] == list(s.configurations)
    assert by_name["envoy_round_robin"] == [(0.5, "steady"), (0.8, "steady"), (0.7, "slowdown")]
    assert by_name["inferlb_pick:round_robin"] == [(0.8, "steady")]
    assert "inferlb_pick:p2c_tokens" in by_name
    only = plan_configurations(s, ["inferlb_ext_proc", "inferlb_pick:least_outstanding"], pick_policies=())
    assert [p.configuration for p in only] == ["inferlb_ext_proc", "inferlb_pick:least_outstanding"]
    none = plan_configurations(replace(s, slowdown=None, pick_policy_loads=()), pick_policies=("round_robin",))
    assert all(r.run == "steady" for p in none for r in p.runs) and len(none) == 6


def test_default_pick_policies_are_the_builtins_but_the_default() -> None:
    from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY, PRESETS

    names = [p.configuration for p in plan_configurations(Scenario())]
    picks = sorted(n.split(":", 1)[1] for n in names if n.startswith("inferlb_pick:"))
    assert picks == sorted(set(PRESETS) - {DEFAULT_PICK_POLICY})


# --- capacity ------------------------------------------------------------------------------------

def test_theoretical_capacity_of_the_default_scenario() -> None:
    s = Scenario()
    assert mean_tokens(s) == pytest.approx(0.7 * 20 + 0.25 * 96 + 0.05 * 256)
    cost = (0.001 + 0.000114 * mean_tokens(s)) * 4.0
    assert theoretical_capacity_rps(s) == pytest.approx(5.5 / cost)
    assert 190 < theoretical_capacity_rps(s) < 215  # the scenario docstring's "~200 req/s"
    two_slots = replace(s, fleet=replace(s.fleet, workers=tuple(WorkerSpec(w.speed, 2) for w in s.fleet.workers)))
    assert theoretical_capacity_rps(two_slots) == pytest.approx(2 * theoretical_capacity_rps(s))


def _search(p99_at, theoretical: float = 100.0, slo: float = 0.25, limit: int = 20) -> list[Probe]:  # type: ignore[no-untyped-def]
    probes: list[Probe] = []
    while len(probes) < limit:
        rps = next_probe_rps(probes, theoretical, slo)
        if rps is None:
            break
        probes.append(Probe(rps, p99_at(rps), 1000, 0))
    return probes


def test_search_brackets_then_bisects_to_the_crossing() -> None:
    # p99 grows linearly and crosses 0.25 s at 80 req/s.
    probes = _search(lambda rps: 0.25 * rps / 80)
    assert probes[0].rps == 100.0  # starts at the theoretical capacity
    assert probes[1].rps == 75.0  # missed: steps down
    assert len(probes) <= 7  # bounded: a few short steps
    assert capacity_from_probes(probes, 100.0, 0.25) == pytest.approx(80.0, rel=0.01)


def test_search_steps_up_when_the_theoretical_load_meets_the_slo() -> None:
    probes = _search(lambda rps: 0.25 * rps / 130)
    assert probes[1].rps == pytest.approx(125.0)
    assert capacity_from_probes(probes, 100.0, 0.25) == pytest.approx(130.0, rel=0.02)


def test_a_probe_measures_8_s_unless_the_scenario_asks_longer_never_past_its_runs() -> None:
    assert PROBE_DURATION_S == 8.0 and probe_duration_s(Scenario()) == 8.0  # the routing bench's search
    assert probe_duration_s(Scenario(duration_s=5.0)) == 5.0
    assert probe_duration_s(Scenario(probe_duration_s=20.0)) == 20.0
    assert probe_duration_s(Scenario(duration_s=6.0, probe_duration_s=20.0)) == 6.0  # --quick's runs


def test_the_overload_scenario_probes_as_long_as_it_runs() -> None:
    # Its verdict is goodput as a share of capacity: an 8 s probe near capacity ends before the queues have
    # grown and finds a load above what the fleet can complete.
    overload = load_scenario(ROOT / "scenarios" / "overload.toml")
    assert probe_duration_s(overload) == overload.duration_s == 20.0


def test_search_gives_up_within_bounds() -> None:
    never = _search(lambda rps: 1.0)  # the SLO cannot be met at any load
    assert never and next_probe_rps(never, 100.0, 0.25) is None and min(p.rps for p in never) >= 10.0
    always = _search(lambda rps: 0.001)
    assert max(p.rps for p in always) <= 200.0
    assert capacity_from_probes(always, 100.0, 0.25) == max(p.rps for p in always)


def test_failed_requests_make_a_probe_miss() -> None:
    assert Probe(100, 0.1, 1000, 0).meets(0.25)
    assert not Probe(100, 0.1, 1000, 50).meets(0.25)  # 5% failed: their latency is unknown
    assert not Probe(100, 0.3, 1000, 0).meets(0.25)


# --- the table -----------------------------------------------------------------------------------

def _result(configuration: str, load: float, p99: float, goodput: float, run: str = "steady") -> RunResult:
    return RunResult(configuration=configuration, load=load, offered_rps=200 * load, duration_s=20, sent=100,
                     completed=100, errors=0, timeouts=0, p50_s=p99 / 4, p90_s=p99 / 2, p99_s=p99, p999_s=p99 * 2,
                     mean_s=p99 / 3, goodput_rps=goodput, slo_s=0.25, run=run, extra={"host_cpu": 0.5})


def test_target_ratios_and_markdown() -> None:
    results = [
        _result("envoy_round_robin", 0.8, 0.800, 100.0),
        _result("envoy_least_request", 0.8, 0.400, 120.0),
        _result("envoy_cswrr_orca", 0.8, 0.500, 110.0),
        _result("inferlb_ext_proc", 0.8, 0.100, 150.0),
        _result("inferlb_ext_proc", 0.5, 0.050, 100.0),
        _result("envoy_least_request", 0.7, 1.000, 90.0, run="slowdown"),
        _result("inferlb_ext_proc", 0.7, 0.200, 130.0, run="slowdown"),
    ]
    ratios = {(r.metric, r.baseline, r.run): r.value for r in target_ratios(results)}
    assert ratios[("p99", "envoy_least_request", "steady")] == pytest.approx(0.25)
    assert ratios[("p99", "envoy_round_robin", "steady")] == pytest.approx(0.125)
    assert ratios[("goodput", "envoy_least_request", "steady")] == pytest.approx(1.25)
    assert ratios[("p99", "envoy_cswrr_orca", "steady")] == pytest.approx(0.2)
    assert ratios[("p99", "envoy_least_request", "slowdown")] == pytest.approx(0.2)
    assert ratios[("p99", "envoy_cswrr_orca", "slowdown")] is None  # not run: no made-up figure

    md = render_markdown(results, capacity_rps=200.0, capacity_note="search")
    assert "Capacity (100% load): 200.0 req/s - search" in md
    assert "| inferlb_ext_proc | steady | 80% | 160.0 | 25.0 | 50.0 | 100.0 | 200.0 | 150.0 | 100 | 0 | 0 | 50% |" in md
    assert "| inferlb_ext_proc p99 / envoy_least_request p99 (80% load) | 0.25x | lower |" in md
    assert "envoy_cswrr_orca p99 (slowdown run)" not in md
    rows = [line for line in md.splitlines() if line.startswith("| inferlb_ext_proc |")]
    assert [row.split("|")[3].strip() for row in rows] == ["50%", "80%", "70%"]  # steady by load, then slowdown


def test_markdown_without_baselines_has_no_targets() -> None:
    md = render_markdown([_result("inferlb_ext_proc", 0.8, 0.1, 150.0)])
    assert "## Targets" not in md


def test_the_spread_is_summarised_by_worker_speed() -> None:
    r = replace(_result("envoy_least_request", 0.8, 0.5, 10.0),
                spread={"h:1": 30, "h:2": 10, "h:3": 5},  # h:4 served nothing
                extra={"worker_speeds": {"h:1": 1.0, "h:2": 1.0, "h:3": 0.25, "h:4": 0.25}})
    assert spread_by_speed(r) == "speed 1: 20/worker, speed 0.25: 2/worker"
    assert "| envoy_least_request | steady | 80% | speed 1: 20/worker, speed 0.25: 2/worker |" in render_markdown([r])
    assert spread_by_speed(replace(r, extra={})) == ""  # no speeds recorded: no spread row
