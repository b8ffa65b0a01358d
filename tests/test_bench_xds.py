"""``inferlb bench xds``: its workload, summary and report, and one configuration end to end (the
control plane's path in its own process, a client fleet over real gRPC, every process stopped)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_plane.model import DataPlaneSettings, FleetState
from inferlb.bench.xds_bench.command import QUICK, int_list, run_isolated
from inferlb.bench.xds_bench.configuration import summarise
from inferlb.bench.xds_bench.report import fmt_bytes, progress_line, table
from inferlb.bench.xds_bench.spec import CONV_TARGET_MS, SINGLE_TARGET_MS, Spec, make_endpoints, reweigh, weight_of
from inferlb.cli import build_parser


def _spec(**changes: object) -> Spec:
    base = Spec(mode="sotw", change="all", endpoints=20, clients=2, envoy=False, rounds=2, warmup=1, telemetry=True,
                health_check_interval_s=60.0, round_timeout_s=30.0, sync_timeout_s=60.0, envoy_path="")
    return replace(base, **changes)  # type: ignore[arg-type]


def test_every_round_changes_every_weight_or_exactly_one() -> None:
    for r in range(1, 5):
        assert all(weight_of(i, r, "all") != weight_of(i, r - 1, "all") for i in range(500))
        assert [i for i in range(500) if weight_of(i, r, "one") != weight_of(i, r - 1, "one")] == [0]
    state = FleetState(endpoints=make_endpoints(300, telemetry=True), settings=DataPlaneSettings())
    assert len({(e.address, e.port) for e in state.endpoints}) == 300
    assert all(e.telemetry is not None for e in state.endpoints)
    assert make_endpoints(3, telemetry=False)[0].telemetry is None
    one = reweigh(state, 1, "one")
    assert [e.computed_weight for e in one.endpoints[1:]] == [e.computed_weight for e in state.endpoints[1:]]
    assert one.endpoints[0].computed_weight != state.endpoints[0].computed_weight


def test_summary_skips_warm_up_and_judges_the_targets() -> None:
    rounds = [{"warmup": True, "conv_ms": 999.0, "push_ms": 1, "build_ms": 1, "cpu_s": 1, "cpu_pct": 1, "rss_mb": 1},
              *({"warmup": False, "conv_ms": c, "push_ms": 2.0, "build_ms": 1.0, "cpu_s": 0.1, "cpu_pct": 50.0,
                 "rss_mb": 80.0, "eds_push_bytes": 1000} for c in (10.0, 30.0, 20.0))]
    s = summarise(_spec(change="one", mode="delta", clients=10), {"rounds": rounds})
    assert s["conv_ms_median"] == 20.0 and s["conv_ms_max"] == 30.0 and s["eds_bytes_per_change"] == 10_000
    assert s["target_ms"] == SINGLE_TARGET_MS and s["target_met"] is True
    big = summarise(_spec(endpoints=10_000, clients=50), {"rounds": rounds})
    assert big["target_ms"] == CONV_TARGET_MS
    assert "target_ms" not in summarise(_spec(), {"rounds": rounds})
    assert summarise(_spec(), {"rounds": rounds[:1]}) == {}


def test_report_lines_and_table() -> None:
    assert (fmt_bytes(None), fmt_bytes(512), fmt_bytes(3040), fmt_bytes(2.5e6)) == ("-", "512 B", "3.04 kB", "2.50 MB")
    failed = {"spec": {"mode": "sotw", "change": "all", "endpoints": 20, "clients": 2, "envoy": False},
              "error": "boom", "summary": {}}
    assert "FAILED boom" in progress_line(_spec(), failed)
    assert "FAILED" in table([failed]).splitlines()[2]
    assert int_list("1, 10,,50") == [1, 10, 50]


def test_quick_mode_parses() -> None:
    args = build_parser().parse_args(["bench", "xds", "--quick", "--no-envoy"])
    assert args.quick and args.no_envoy and args.func.__module__ == "inferlb.bench.xds_bench.command"
    assert int_list(QUICK["clients"]) == [1, 10]


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.parametrize("mode", ["sotw", "delta"])
def test_one_configuration_end_to_end(mode: str) -> None:
    """A fresh control-plane process publishes weight changes to a fleet of two ADS clients (a child of that
    process), which ACK them; every round converges and the bytes each client received are counted."""
    result = run_isolated(_spec(mode=mode))
    assert result["ok"], result.get("error")
    measured = [r for r in result["rounds"] if not r["warmup"]]
    assert len(measured) == 2 and all(r["conv_ms"] > 0 and r["eds_push_bytes"] > 0 for r in measured)
    assert result["summary"]["eds_bytes_source"] == "client" and result["nacks"] == {}
