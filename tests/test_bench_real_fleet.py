"""Real ONNX workers in the routing bench (issue 19, item 3): the scenario form, the cgroups, the cost
curves' arithmetic, and a tiny real fleet through ``inferlb bench run`` end to end.

The end-to-end run is seconds long on a shared host: it proves the plumbing (calibration, quotas,
the runs, the cleanup), not the figures, so no figure is judged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from inferlb.bench.stack.cpu_quota import CpuQuotas, candidates
from inferlb.bench.stack.real_fleet import real_worker_argv
from inferlb.bench.routing.real_fleet_calibration import TokenPoint, fit_cost, mix_lengths
from inferlb.bench.routing.real_fleet_report import best_peer_lines
from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import LengthBucket, ScenarioError, load_scenario, scenario_from_mapping

from .test_bench_run import INFERLB, leftovers

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "scenarios" / "real_workers.toml"

TINY = """
name = "real_tiny"
seed = 3
duration_s = 1.5
warmup_s = 0.5
slo_s = 1.0
capacity_rps = 6.0
loads = [0.5]
slowdown = false
configurations = ["inferlb_ext_proc"]
pick_policy_loads = []

[workload]
mix = [{ share = 1.0, min_tokens = 16, max_tokens = 48 }]

[fleet]
kind = "onnx"
calibration = "quick"
workers = [{ precision = "int8" }, { precision = "int8", cpu_quota = 0.5 }]
"""


def _onnx(**fleet: object) -> dict[str, object]:
    return {"slowdown": False, "fleet": {"kind": "onnx", **fleet}}


def test_the_real_workers_scenario_parses_into_a_real_fleet() -> None:
    s = load_scenario(REAL)
    assert s.fleet.kind == "onnx" and s.slowdown is None
    assert [w.kind for w in s.fleet.workers] == ["int8 1t q0.7", "fp32 2t q0.5", "int8 1t q0.3"]
    assert s.loads == (0.7, 0.8, 0.9)
    assert {"envoy_round_robin", "envoy_least_request", "envoy_cswrr_orca", "nginx_least_conn",
            "inferlb_ext_proc"} <= set(s.configurations)


@pytest.mark.parametrize(("data", "message"), [
    (_onnx(workers=[{"precision": "int4"}]), "fleet.workers[0].precision must be one of int8, fp32"),
    (_onnx(workers=[{"threads": 0}]), "fleet.workers[0].threads must be an integer in [1, 64]"),
    (_onnx(workers=[{"cpu_quota": 0.001}]), "fleet.workers[0].cpu_quota is a fraction of a core"),
    (_onnx(workers=[{"slots": 2}]), "fleet.workers[0].slots is for emulated workers"),
    (_onnx(workers=[{}], calibration="long"), "fleet.calibration must be 'full' or 'quick'"),
    ({"slowdown": False, "fleet": {"kind": "gpu"}}, "fleet.kind must be one of emulated, onnx"),
    ({"fleet": {"kind": "onnx", "workers": [{}]}}, "slowdown needs an emulated fleet"),
    ({"fleet": {"workers": [{"cpu_quota": 0.5}]}}, 'fleet.workers[0].cpu_quota is for real workers'),
])
def test_bad_real_fleets_are_refused_by_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        scenario_from_mapping(data)
    assert message in str(err.value)


def test_a_real_worker_serves_its_precision_and_threads_without_a_cache(tmp_path: Path) -> None:
    s = scenario_from_mapping(_onnx(workers=[{"precision": "fp32", "threads": 2, "cpu_quota": 0.5}]))
    argv = real_worker_argv(s.fleet, 0, "127.0.0.1", 8123, tmp_path, python="py")
    assert argv[:3] == ["py", "-m", "workers"] and "--simulate" not in argv
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--precision"] == "fp32" and pairs["--threads"] == "2" and pairs["--port"] == "8123"
    assert pairs["--cache-max-bytes"] == "0" and pairs["--cpus"] == "0.5" and pairs["--data-dir"] == str(tmp_path)


MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 {v2} cgroup2 rw,relatime 0 0
"""


def test_candidates_put_a_v2_mount_with_the_cpu_controller_before_v1(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    own = "0::/job\n4:memory:/x\n1:cpu:/slice/a\n"
    found = candidates(MOUNTS.format(v2=tmp_path), own)
    assert [(c.version, c.own) for c in found] == [(2, tmp_path / "job"), (1, Path("/sys/fs/cgroup/cpu/slice/a"))]
    (tmp_path / "cgroup.controllers").write_text("hugetlb\n")  # v2 without cpu: only v1 is left
    assert [c.version for c in candidates(MOUNTS.format(v2=tmp_path), own)] == [1]
    assert candidates("proc /proc proc rw 0 0\n", own) == []


def test_quotas_are_skipped_with_the_reason_when_no_cpu_cgroup_is_mounted(tmp_path: Path) -> None:
    (tmp_path / "mounts").write_text("proc /proc proc rw 0 0\n")
    (tmp_path / "cgroup").write_text("0::/\n")
    lines: list[str] = []
    with CpuQuotas(report=lines.append, mounts=tmp_path / "mounts", self_cgroup=tmp_path / "cgroup") as quotas:
        assert quotas.limit("w", 0.5) is None and quotas.place("w", os.getpid()) is False
    assert quotas.mechanism == "skipped: no cgroup hierarchy with the cpu controller is mounted"
    assert lines == ["CPU quotas skipped: no cgroup hierarchy with the cpu controller is mounted"]


@pytest.mark.subprocess
def test_a_quota_group_holds_a_process_and_is_removed_even_when_the_run_fails() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(RuntimeError, match="the run failed"):
            with CpuQuotas() as quotas:
                if quotas.place_ is None:
                    pytest.skip(f"no writable cpu cgroup here: {quotas.skipped}")
                group = quotas.limit("w0", 0.25)
                assert group is not None and group.is_dir()
                quota = (group / "cpu.max").read_text().split() if quotas.place_.version == 2 else \
                    [(group / "cpu.cfs_quota_us").read_text().strip(), (group / "cpu.cfs_period_us").read_text().strip()]
                assert int(quota[0]) / int(quota[1]) == pytest.approx(0.25)
                assert quotas.place("w0", sleeper.pid) and quotas.members("w0") == [sleeper.pid]
                raise RuntimeError("the run failed")
        assert not group.exists() and not group.parent.exists()
        assert sleeper.poll() is None  # moved back out, not killed
    finally:
        sleeper.kill()
        sleeper.wait()


def test_fit_cost_recovers_a_line_and_mix_lengths_follow_the_buckets() -> None:
    points = [TokenPoint(n, 10, 2.0 + 0.1 * n, 0.0) for n in (8, 64, 256)]
    fixed_ms, per_token_us = fit_cost(points)
    assert fixed_ms == pytest.approx(2.0) and per_token_us == pytest.approx(100.0)
    lengths = mix_lengths((LengthBucket(0.5, 10, 12), LengthBucket(0.5, 200, 200)), 400, seed=1)
    assert set(lengths) <= {10, 11, 12, 200} and 100 < lengths.count(200) < 300
    assert lengths == mix_lengths((LengthBucket(0.5, 10, 12), LengthBucket(0.5, 200, 200)), 400, seed=1)


def _run(configuration: str, load: float, p99_s: float, goodput: float = 10.0) -> RunResult:
    return RunResult(configuration, load, 10.0, 10.0, 100, 100, 0, 0, p99_s / 2, p99_s, p99_s, p99_s, p99_s / 2,
                     goodput, 0.4)


def test_best_peer_lines_compare_with_the_lowest_peer_p99_and_judge_80_percent() -> None:
    results = [_run("envoy_round_robin", 0.8, 2.0), _run("nginx_least_conn", 0.8, 0.5),
               _run("inferlb_ext_proc", 0.8, 0.3, 12.0), _run("nginx_least_conn", 0.7, 0.2),
               _run("inferlb_ext_proc", 0.7, 0.2)]
    text = "\n".join(best_peer_lines(results))
    assert "| 80% | 300.0 | nginx_least_conn | 500.0 | 0.60x | 12.0 / 10.0 | met |" in text
    assert "| 70% | 200.0 | nginx_least_conn | 200.0 | 1.00x | 10.0 / 10.0 |  |" in text
    assert best_peer_lines([_run("inferlb_ext_proc", 0.8, 0.3)]) == []


def _our_cgroups() -> list[Path]:
    return [p for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
            if root.is_dir() for p in root.glob("inferlb-bench-*")]


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "out"
    for proc in psutil.process_iter():  # a failed test must not leak processes into the next
        if proc.pid != os.getpid() and str(tmp_path) in " ".join(proc.cmdline() if proc.is_running() else []):
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.model
@pytest.mark.nginx
@pytest.mark.wrk
@pytest.mark.slow
def test_a_tiny_real_fleet_runs_through_the_bench_and_leaves_nothing_behind(out: Path) -> None:
    scenario = out.parent / "tiny.toml"
    scenario.write_text(TINY)
    before = set(_our_cgroups())
    done = subprocess.run([*INFERLB, "bench", "run", "--scenario", str(scenario), "--out", str(out), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr

    data = json.loads((out / "results.json").read_text())
    cal = data["calibration"]
    assert [c["kind"] for c in cal["curves"]] == ["int8 1t", "int8 1t q0.5"]
    for curve in cal["curves"]:
        assert [p["tokens"] for p in curve["tokens"]] == [16, 128]
        assert [q["concurrency"] for q in curve["queue"]] == [1, 4]
        assert all(q["requests"] > 0 and q["errors"] == 0 for q in curve["queue"])
    (result,) = data["results"]
    assert result["configuration"] == "inferlb_ext_proc" and result["completed"] > 0
    assert result["errors"] == 0 and result["timeouts"] == 0
    assert set(result["extra"]["worker_kinds"].values()) == {"int8 1t", "int8 1t q0.5"}
    assert sum(result["spread"].values()) == result["completed"]
    table = (out / "table.md").read_text()
    assert "## Cost curves (real workers)" in table and "| int8 1t q0.5 |" in table
    log = (out / "logs" / "bench.log").read_text()
    if cal["cpu_quota"].startswith("skipped"):
        assert "CPU quotas skipped" in done.stderr
    else:  # the quota worker of each fleet was held to its quota, and only it
        assert "held to 0.5 core" in log and log.count("held to") == 1
    assert set(_our_cgroups()) <= before  # every group the bench made is gone
    assert leftovers(str(out)) == []
