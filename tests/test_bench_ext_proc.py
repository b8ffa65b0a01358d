"""``inferlb bench ext-proc``: its workload, figures and targets, its one static Envoy config (from
control_plane.resources) through a real Envoy, and the trivial servicer (the floor) over real gRPC."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from control_plane import resources
from control_plane.config import DataPlaneConfig
from ext_proc.fronts.grpc_settings import GRPC_EXPERIMENTS_DEFAULT
from inferlb.bench.stack.dataplanes.envoy_static import _manager, static_bootstrap
from inferlb.bench.ext_proc_bench.command import QUICK, settle
from inferlb.bench.ext_proc_bench.grpc_load import grpc_drive
from inferlb.bench.ext_proc_bench.overhead import generator_kept_up, summarise
from inferlb.bench.ext_proc_bench.profile import dso_group
from inferlb.bench.ext_proc_bench.report import report, targets
from inferlb.bench.ext_proc_bench.stack import (
    ext_proc_filter_stats, fake_worker, static_envoy, trivial_servicer, trivial_uds,
)
from inferlb.bench.ext_proc_bench.workload import cycled, make_bodies, schedule
from inferlb.bench.load.loadgen import LoadOutcome
from inferlb.bench.processes import ProcessGroup
from inferlb.cli import build_parser

from .stack import envoy_binary

ENDPOINTS = [("127.0.0.1", 18101), ("127.0.0.1", 18102)]


# --- workload, figures, targets ------------------------------------------------------------------

def test_bodies_are_distinct_real_embeddings_requests() -> None:
    bodies = make_bodies(64, seed=1)
    assert len(set(bodies)) == 64 and bodies == make_bodies(64, seed=1)
    doc = json.loads(bodies[0])
    assert doc["model"] == "all-MiniLM-L6-v2" and doc["encoding_format"] == "base64" and doc["input"]
    assert cycled(bodies[:3], 7) == bodies[:3] * 2 + bodies[:1]


def test_schedules_poisson_and_uniform() -> None:
    uniform = schedule(100, 2, "uniform", 1)
    assert len(uniform) == 200 and uniform.send_at_s[1] == pytest.approx(0.01)
    poisson = schedule(100, 2, "poisson", 1)
    assert 120 < len(poisson) < 280 and all(0 <= t < 2 for t in poisson.send_at_s)
    assert list(poisson.send_at_s) == list(schedule(100, 2, "poisson", 1).send_at_s)  # seeded
    with pytest.raises(ValueError, match="poisson or uniform"):
        schedule(100, 2, "bursty", 1)


def _outcome(latencies_s: list[float], lag_s: float, cpu_s: float) -> LoadOutcome:
    outcome = LoadOutcome(offered_rps=100, measured_s=1.0, slo_s=1.0, sent=len(latencies_s),
                          completed=len(latencies_s), send_lag_p99_s=lag_s, send_lag_max_s=lag_s,
                          client_cpu_s=cpu_s, wall_s=1.0)
    for seconds in latencies_s:
        outcome.histogram.record(seconds)
        outcome.service.record(seconds / 2)
    return outcome


def test_rounds_are_merged_and_the_generator_judged() -> None:
    s = summarise([_outcome([0.001] * 50, 0.0005, 0.1), _outcome([0.003] * 50, 0.001, 0.1)])
    assert s["requests"] == s["completed"] == 100 and s["errors"] == 0
    assert s["p50_ms"] == pytest.approx(1.0, rel=0.01) and s["p99_ms"] == pytest.approx(3.0, rel=0.01)
    assert s["service_p99_ms"] == pytest.approx(1.5, rel=0.01)
    assert s["lag_p99_ms"] == pytest.approx(1.0) and s["generator_cores"] == pytest.approx(0.1)
    assert generator_kept_up(s)
    assert not generator_kept_up({**s, "lag_p99_ms": 2.5})
    assert not generator_kept_up({**s, "generator_cores": 0.6})


def test_targets_prefer_the_pinned_grpc_figure() -> None:
    results = {"overhead": {"500": {"added": {"p50_ms": 0.8}}},
               "saturation_grpc": {"ext_proc": {"per_s": 4100.0, "per_cpu_s": 4200.0, "cores": {"server": 0.98}}},
               "saturation_fake_worker": {"ext_proc": {"per_server_cpu_s": 10.0}}}
    t = targets(results)
    assert t["added p50 <= 1 ms at 500 req/s"]["met"] is True
    assert t[">= 4000 decisions/s on one core"] == {"value": "4100/s at 0.98 cores = 4200 per CPU-second",
                                                    "met": True}
    assert targets({})[">= 4000 decisions/s on one core"]["met"] is None


def test_the_report_sets_the_native_front_beside_grpcios_in_the_same_run() -> None:
    def entry(per_cpu_s: float) -> dict:
        return {"per_s": per_cpu_s / 2, "per_cpu_s": per_cpu_s, "cores": {"server": 0.5, "client": 1.0}}

    direct = {"ext_proc_tcp": entry(5000.0), "ext_proc_grpcio_tcp": entry(2500.0),
              "ext_proc_uds": entry(5400.0), "ext_proc_grpcio_uds": entry(2700.0), "trivial_tcp": entry(4000.0)}
    results = {"machine": {"cpus": 2, "loadavg_start": [0.5], "loadavg_end": [0.5]}, "saturation_grpc": direct,
               "ext_proc_front": "native"}
    args = build_parser().parse_args(["bench", "ext-proc", "--quick"])
    settle(args)
    lines: list[str] = []
    report(results, args, lines.append)
    text = "\n".join(lines)
    assert "ext_proc alone (on its native front)" in text
    assert "ext_proc on grpcio's front over TCP" in text and "2500 per CPU-second" in text
    assert "native front / grpcio's, over TCP (same run): 2.00" in text
    assert "native front / grpcio's, over UDS (same run): 2.00" in text
    assert "the trivial servicer's over TCP (same run): 1.25" in text


def test_the_bench_reads_ext_procs_front_from_its_metrics() -> None:
    from prometheus_client import generate_latest

    from ext_proc.metrics import ExtProcMetrics
    from inferlb.bench.stack.dataplanes.launch import grpc_front

    metrics = ExtProcMetrics()
    assert grpc_front(generate_latest(metrics.registry).decode()) is None  # not serving yet
    metrics.grpc_front = "native"
    assert grpc_front(generate_latest(metrics.registry).decode()) == "native"


@pytest.mark.parametrize(("dso", "group"), [
    ("libc.so.6", "libc / libstdc++ / malloc / the loader"),
    ("libstdc++.so.6.0.30", "libc / libstdc++ / malloc / the loader"),  # was "other": only "libc" matched
    ("ld-linux-x86-64.so.2", "libc / libstdc++ / malloc / the loader"),
    ("libcrypto.so.3", "other"),  # "libc" is in its name, and it is not libc
    ("libpython3.11.so.1.0", "Python interpreter (ext_proc, asyncio, grpc's Python code)"),
    ("libabsl_synchronization.so.20220623.0.0", "gRPC C++ + abseil (the native front)"),
    ("[kernel.kallsyms]", "kernel (syscalls, loopback TCP, scheduling)"),
])
def test_perf_groups_shared_objects_by_name(dso: str, group: str) -> None:
    assert dso_group(dso) == group


def test_quick_mode_and_options_parse() -> None:
    args = build_parser().parse_args(["bench", "ext-proc", "--quick", "--rates", "100,300"])
    settle(args)
    assert args.rates == [100, 300] and all(getattr(args, k) == v for k, v in QUICK.items())
    assert args.func.__module__ == "inferlb.bench.ext_proc_bench.command"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "ext-proc", "--rates", "fast"])


# --- the one static Envoy config -----------------------------------------------------------------

def _settings(**changes: object):  # type: ignore[no-untyped-def]
    return DataPlaneConfig(listener_port=20001, ext_proc_port=20003, **changes).settings()  # type: ignore[arg-type]


def test_static_bootstrap_is_the_control_planes_own_resources() -> None:
    settings = _settings()
    bootstrap = static_bootstrap(settings, ENDPOINTS, admin_port=20002)
    listener, cluster, ext_cluster = (bootstrap.static_resources.listeners[0], *bootstrap.static_resources.clusters)
    _, manager = _manager(listener)
    _, theirs = _manager(resources.build_listener(settings))
    assert [f.name for f in manager.http_filters] == [f.name for f in theirs.http_filters]
    assert list(manager.http_filters) == list(theirs.http_filters)
    assert manager.local_reply_config == theirs.local_reply_config
    assert manager.route_config.virtual_hosts == resources.build_route_configuration(settings).virtual_hosts
    own = resources.build_workers_cluster(settings)
    assert cluster.type == cluster_pb2.Cluster.STATIC and not cluster.HasField("eds_cluster_config")
    assert cluster.health_checks == own.health_checks and cluster.circuit_breakers == own.circuit_breakers
    assert cluster.load_balancing_policy == own.load_balancing_policy
    assert [e.endpoint.address.socket_address.port_value for e in cluster.load_assignment.endpoints[0].lb_endpoints] \
        == [18101, 18102]
    assert ext_cluster == resources.build_ext_proc_cluster(settings)


def test_static_bootstrap_variants() -> None:
    without = static_bootstrap(_settings(ext_proc_enabled=False, retries=0), ENDPOINTS, admin_port=1)
    _, manager = _manager(without.static_resources.listeners[0])
    assert resources.EXT_PROC_FILTER not in [f.name for f in manager.http_filters]
    assert len(without.static_resources.clusters) == 1
    assert not manager.route_config.virtual_hosts[0].routes[0].route.HasField("retry_policy")
    for messages, headers in ((2, processing_mode_pb2.ProcessingMode.SEND),
                              (1, processing_mode_pb2.ProcessingMode.SKIP)):
        _, manager = _manager(static_bootstrap(_settings(), ENDPOINTS, admin_port=1,
                                               ext_proc_messages=messages).static_resources.listeners[0])
        (f,) = [f for f in manager.http_filters if f.name == resources.EXT_PROC_FILTER]
        config = ext_proc_pb2.ExternalProcessor()
        f.typed_config.Unpack(config)
        assert config.processing_mode.response_header_mode == processing_mode_pb2.ProcessingMode.SKIP
        assert config.processing_mode.request_header_mode == headers
    direct = static_bootstrap(_settings(), ENDPOINTS, admin_port=1, direct_response=b"{}")
    _, manager = _manager(direct.static_resources.listeners[0])
    assert manager.route_config.virtual_hosts[0].routes[0].direct_response.body.inline_bytes == b"{}"
    with pytest.raises(ValueError, match="at least one endpoint"):
        static_bootstrap(_settings(), [], admin_port=1)
    with pytest.raises(ValueError, match="1, 2 or 3"):
        static_bootstrap(_settings(), ENDPOINTS, admin_port=1, ext_proc_messages=4)


@pytest.mark.envoy
@pytest.mark.parametrize("messages", [1, 2, 3])
def test_static_bootstrap_with_ext_proc_validates_with_the_real_envoy(messages: int, tmp_path: Path) -> None:
    envoy = static_envoy(envoy_binary(), tmp_path, f"v{messages}", ENDPOINTS, ext_proc_port=20003, messages=messages)
    config = envoy.component.argv[2]
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", config, "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- through the real wire -----------------------------------------------------------------------

def _messages(body: bytes) -> list[tuple[bytes, bytes, bytes]]:
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders()).SerializeToString()
    request_body = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()
    response = pb.ProcessingRequest(response_headers=pb.HttpHeaders()).SerializeToString()
    return [(headers, request_body, response)]


@pytest.mark.servers
def test_the_grpc_client_reads_past_a_timeout_extension_to_the_answer() -> None:
    """ext_proc answers a body that waits in its fair queue first with an override_message_timeout; Envoy
    takes it and waits on, and so must the bench's client, or every later read is one message behind."""
    import grpc
    from google.protobuf import duration_pb2

    extension = pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=6)).SerializeToString()
    answer = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()

    async def process(requests, context):  # type: ignore[no-untyped-def]
        async for request in requests:
            if pb.ProcessingRequest.FromString(request).HasField("request_body"):
                yield extension
            yield answer

    async def scenario() -> dict:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(process)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await grpc_drive(f"127.0.0.1:{port}", _messages(b"{}"), streams=2, seconds=0.5)
        finally:
            await server.stop(None)

    figures = asyncio.run(scenario())
    assert figures["streams_ok"] > 0 and figures["errors"] == {}


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.parametrize("front", ["grpcio", pytest.param("native", marks=pytest.mark.native)])
def test_the_trivial_servicer_answers_envoys_three_messages(front: str, tmp_path: Path) -> None:
    async def scenario() -> dict:
        async with ProcessGroup() as group:
            component, port = trivial_servicer(tmp_path, front)
            await group.start([component])
            figures = await grpc_drive(f"127.0.0.1:{port}", _messages(b"{}"), streams=2, seconds=0.5)
            over_uds = await grpc_drive(f"unix:{trivial_uds(tmp_path, front)}", _messages(b"{}"), streams=2,
                                        seconds=0.5)
            assert over_uds["streams_ok"] > 0 and over_uds["errors"] == {}
            return figures

    figures = asyncio.run(scenario())
    assert figures["streams_ok"] > 0 and figures["errors"] == {}


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_a_static_envoy_streams_each_request_through_the_floor_servicer(tmp_path: Path) -> None:
    """The bench's static Envoy (the control plane's listener, ext_proc filter and clusters) in front of a fake
    worker, with the trivial servicer as its ext_proc: a request answers 200 and opens one ext_proc stream."""
    answer = httpx.Response(200, headers={"content-type": "application/json"}, text='{"data": []}')

    async def scenario() -> tuple[int, dict[str, int], str]:
        async with ProcessGroup() as group, httpx.AsyncClient(timeout=5, trust_env=False) as client:
            fake, upstream = fake_worker(envoy_binary(), tmp_path, answer)
            trivial, trivial_port = trivial_servicer(tmp_path)
            await group.start([fake, trivial])
            envoy = static_envoy(envoy_binary(), tmp_path, "wire", [("127.0.0.1", upstream)],
                                 ext_proc_port=trivial_port)
            await group.start([envoy.component])
            response = await client.post(f"http://127.0.0.1:{envoy.listener_port}/v1/embeddings",
                                         content=make_bodies(1, 1)[0], headers={"content-type": "application/json"})
            return response.status_code, await ext_proc_filter_stats(client, envoy.admin_url), response.text

    status, stats, text = asyncio.run(scenario())
    assert status == 200 and text == '{"data": []}'
    assert stats["streams_started"] == 1 and stats["failure_mode_allowed"] == 0


def test_a_variant_reports_its_median_round_and_every_rounds_rate() -> None:
    from inferlb.bench.ext_proc_bench.saturation import median_round

    rounds = [{"rps": 10.0, "per_server_cpu_s": r, "n": i} for i, r in enumerate((300.0, 100.0, 200.0, 400.0))]
    picked = median_round(rounds)
    assert (picked["n"], picked["rounds"]) == (2, [300, 100, 200, 400])  # the lower middle of an even count
    assert median_round([{"rps": 5.0}, {"rps": 7.0}, {"rps": 6.0}])["rps"] == 6.0  # no server: by req/s


@pytest.mark.subprocess
def test_the_trivial_servicer_runs_on_the_grpc_ext_proc_sets() -> None:
    """The floor is grpc as ext_proc runs it: GRPC_EXPERIMENTS set to ext_proc's default before grpc loads
    (left alone when the operator set it). The server's loop is replaced by one that only reports."""
    code = ("import os, sys, uvloop\n"
            "def report(coro):\n"
            "    coro.close()\n"
            "    print(os.environ['GRPC_EXPERIMENTS'], 'grpc' in sys.modules)\n"
            "uvloop.run = report\n"
            "from inferlb.bench.ext_proc_bench import trivial\n"
            "trivial.main(['1', '2'])\n")
    for given, expected in ((None, f"{GRPC_EXPERIMENTS_DEFAULT} False"), ("", " False")):
        env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
        if given is not None:
            env["GRPC_EXPERIMENTS"] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.rstrip("\n") == expected
