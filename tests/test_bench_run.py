"""``inferlb bench run`` end to end: the smoke scenario through the real fleet, Envoy, nginx and inferlb.

Runs the CLI as a subprocess writing into ``tmp_path`` and checks what it
wrote and that it left no process behind (on success and on Ctrl-C). Figures
are not judged here: a seconds-long run on a shared host proves the plumbing,
not the balancer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from .conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "scenarios" / "smoke.toml"
INFERLB = [sys.executable, "-c", "import sys; from inferlb.cli import main; sys.exit(main())"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _mentions(proc: psutil.Process, marker: str) -> bool:
    try:
        if any(marker in part for part in proc.cmdline()):
            return True
        return any(marker in value for value in proc.environ().values())
    except psutil.Error:
        return False


def leftovers(marker: str) -> list[str]:
    """Processes whose command line or environment mentions ``marker`` (this test's directory)."""
    me = os.getpid()
    return [" ".join(p.cmdline()[:4]) for p in psutil.process_iter() if p.pid != me and _mentions(p, marker)]


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "out"
    for proc in psutil.process_iter():  # a failed test must not leak processes into the next
        if proc.pid != os.getpid() and _mentions(proc, str(tmp_path)):
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.nginx
@pytest.mark.subprocess
def test_smoke_scenario_writes_results_table_and_plots(out: Path) -> None:
    done = bench("--scenario", str(SMOKE), "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr

    data = json.loads((out / "results.json").read_text())
    assert data["scenario"]["name"] == "smoke"
    assert data["capacity"]["rps"] == 30.0 and data["capacity"]["source"] == "scenario"
    results = data["results"]
    assert [r["configuration"] for r in results] == ["envoy_round_robin", "nginx_least_conn", "inferlb_ext_proc"]
    trace_lengths = set()
    for r in results:
        assert r["completed"] > 0, r
        assert r["errors"] == 0 and r["timeouts"] == 0, r
        assert 0 < r["p50_s"] <= r["p99_s"] <= r["p999_s"]
        assert r["load"] == 0.5 and r["offered_rps"] == 15.0
        # Every response named its worker, and only the fleet's workers answered.
        assert set(r["spread"]) and "?" not in r["spread"]
        assert sum(r["spread"].values()) == r["completed"]
        assert 0 <= r["extra"]["host_cpu"] <= 1
        trace_lengths.add(r["sent"] + r["extra"]["warmup_sent"])
    assert len(trace_lengths) == 1  # the same trace for every configuration
    workers = {w for r in results for w in r["spread"]}
    assert len(workers) <= 3
    # ext_proc really picked (its decisions went up during the run).
    assert results[2]["extra"]["pick_decisions"].get("least_completion_time", 0) > 0

    table = (out / "table.md").read_text()
    for configuration in ("envoy_round_robin", "nginx_least_conn", "inferlb_ext_proc"):
        assert f"| {configuration} | steady | 50% |" in table
        assert f"| {configuration} | steady | 50% |" in done.stdout  # printed at the end too
    for png in ("cdf_load50.png", "load_latency.png"):
        data_png = (out / png).read_bytes()
        assert data_png.startswith(PNG_MAGIC) and len(data_png) > 5000
    assert leftovers(str(out)) == []


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.nginx
@pytest.mark.subprocess
def test_rounds_rotate_the_order_and_the_verdict_rests_on_their_medians(out: Path) -> None:
    done = bench("--scenario", str(SMOKE), "--out", str(out), "--no-progress", "--rounds", "2",
                 "--configurations", "nginx_least_conn,inferlb_ext_proc")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 configuration(s) x 2 rounds, 4 run(s)" in done.stderr and "(round 2 of 2)" in done.stderr
    results = json.loads((out / "results.json").read_text())["results"]
    assert [(r["configuration"], r["round"]) for r in results] == [
        ("nginx_least_conn", 1), ("inferlb_ext_proc", 1), ("inferlb_ext_proc", 2), ("nginx_least_conn", 2)]
    assert len({r["extra"]["seed"] for r in results}) == 1  # every round replays the same trace
    for r in results:
        assert r["completed"] > 0 and r["errors"] == 0 and r["timeouts"] == 0, r
    table = (out / "table.md").read_text()
    assert "## Medians over 2 rounds" in table and "| inferlb_ext_proc | steady | 50% | 2 |" in table
    assert table in done.stdout
    assert (out / "cdf_load50.png").read_bytes().startswith(PNG_MAGIC)
    assert leftovers(str(out)) == []


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.nginx
@pytest.mark.subprocess
def test_ctrl_c_stops_every_process(out: Path) -> None:
    # SIGINT back to its default in the child: when the suite was started with SIGINT ignored (`(make test &)`
    # from a script), the bench inherits that and rightly ignores Ctrl-C; this test would then hang
    process = subprocess.Popen([*INFERLB, "bench", "run", "--scenario", str(SMOKE), "--out", str(out),
                                "--no-progress", "--duration", "30"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # Interrupt in the middle of the first run: the fleet and Envoy are up and under load.
        wait_until(lambda: process.poll() is not None or (out / "runs" / "envoy_round_robin" / "logs" / "envoy.log")
                   .exists() and len(leftovers(str(out))) >= 4, 120, "the first data plane to start")
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
def test_bad_scenario_exits_2_naming_the_field(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.toml"
    scenario.write_text("loads = [0.5, 3.0]\n")
    done = bench("--scenario", str(scenario), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "loads" in done.stderr and "Traceback" not in done.stderr
    scenario.write_text("[fleet]\nworkerz = [1.0]\n")
    done = bench("--scenario", str(scenario))
    assert done.returncode == 2 and "workerz" in done.stderr


@pytest.mark.subprocess
def test_bad_flags_exit_2(tmp_path: Path) -> None:
    done = bench("--scenario", str(SMOKE), "--configurations", "envoy_round_robin,haproxy")
    assert done.returncode == 2 and "haproxy" in done.stderr
    done = bench("--scenario", str(SMOKE), "--loads", "0.5,lots")
    assert done.returncode == 2 and "--loads" in done.stderr
    done = bench("--scenario", str(SMOKE), "--duration", "-1")
    assert done.returncode == 2 and "duration_s" in done.stderr
    for rounds in ("0", "21"):
        done = bench("--scenario", str(SMOKE), "--rounds", rounds)
        assert done.returncode == 2 and f"--rounds must be 1 to 20, got {rounds}" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.subprocess
def test_help_names_the_configurations() -> None:
    done = bench("--help")
    assert done.returncode == 0
    for word in ("--scenario", "--configurations", "--loads", "--duration", "--out", "--no-progress",
                 "envoy_cswrr_orca", "nginx_least_conn", "inferlb_pick:<policy>"):
        assert word in done.stdout


@pytest.mark.subprocess
def test_missing_scenario_file_exits_2(tmp_path: Path) -> None:
    done = bench("--scenario", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "nope.toml" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing was started
