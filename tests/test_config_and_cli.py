"""Worker configuration precedence and validation, and the command lines' --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.config import WorkerConfig, load_config

from .conftest import ROOT


def test_defaults_match_the_contract() -> None:
    config = WorkerConfig()
    assert (config.host, config.port, config.precision) == ("127.0.0.1", 8101, "int8")
    assert config.intra_op_threads == 1 and config.allow_spinning is False


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.toml"
    path.write_text("[worker]\nport = 9000\nprecision = 'fp32'\nmax_batch_tokens = 1024\n")
    env = {"INFERLB_WORKER_PORT": "9100", "INFERLB_WORKER_ALLOW_SPINNING": "true"}
    config = load_config(path, {"max_batch_tokens": 2048, "host": None}, environ=env)
    assert config.port == 9100  # env beats file
    assert config.precision == "fp32"  # file beats default
    assert config.max_batch_tokens == 2048  # flag beats file
    assert config.allow_spinning is True
    assert config.host == "127.0.0.1"  # an unset flag changes nothing


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"INFERLB_WORKER_PORT": "eighty"}, "port: expected int"),
        ({"INFERLB_WORKER_PORT": "70000"}, "port must be 1..65535"),
        ({"INFERLB_WORKER_PRECISION": "int4"}, "precision must be int8 or fp32"),
        ({"INFERLB_WORKER_MAX_BATCH_SIZE": "0"}, "max_batch_size must be >= 1"),
        ({"INFERLB_WORKER_ALLOW_SPINNING": "maybe"}, "expected a boolean"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        load_config(environ=env)


def test_unknown_file_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.toml"
    path.write_text("[worker]\nprot = 9000\n")
    with pytest.raises(ValueError, match="unknown \\[worker\\] keys: prot"):
        load_config(path, environ={})


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        ([sys.executable, "-m", "workers", "--help"], "OpenAI-compatible"),
        ([sys.executable, "-m", "workers", "prepare", "--help"], "fp32 and int8"),
        ([sys.executable, "-m", "inferlb.cli", "--help"], "up"),
        ([sys.executable, "-m", "inferlb.cli", "up", "--help"], "--workers"),
        ([sys.executable, "-m", "inferlb.cli", "up", "--help"], "--dataplane {envoy,nginx}"),
        ([sys.executable, "-m", "inferlb.cli", "status", "--help"], "3 no stack is running"),
        ([sys.executable, "-m", "inferlb.bootstrap", "--help"], "--xds-address"),
    ],
)
def test_every_command_has_help(argv: list[str], expect: str) -> None:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout


@pytest.mark.subprocess
def test_a_bad_setting_exits_2_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--port", "0"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == 2
    assert "port must be 1..65535" in out.stderr


@pytest.mark.subprocess
def test_the_bench_says_which_of_your_settings_its_components_run_without() -> None:
    """The bench keeps INFERLB_* from what it starts (a developer's settings must not change a benchmark); it
    says so, or a run could be taken for one with those settings. INFERLB_DATA_DIR it uses itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLB_")}
    env.update(INFERLB_EXT_PROC_FAIR_QUEUE_DEPTH="1", INFERLB_CP_DATA_PLANE__RETRIES="0",
               INFERLB_DATA_DIR=os.environ.get("INFERLB_DATA_DIR", "/nonexistent"))
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "bench", "run", "--scenario", "/nonexistent.toml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 2 and "cannot read scenario" in out.stderr
    note = next(line for line in out.stderr.splitlines() if line.startswith("inferlb bench: "))
    assert "INFERLB_CP_DATA_PLANE__RETRIES, INFERLB_EXT_PROC_FAIR_QUEUE_DEPTH:" in note
    assert "INFERLB_DATA_DIR" not in note
    del env["INFERLB_EXT_PROC_FAIR_QUEUE_DEPTH"], env["INFERLB_CP_DATA_PLANE__RETRIES"]
    quiet = subprocess.run([sys.executable, "-m", "inferlb.cli", "bench", "run", "--scenario", "/nonexistent.toml"],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert quiet.returncode == 2 and "inferlb bench: " not in quiet.stderr


# --- `inferlb up` / `inferlb status`: command lines, the status file and the lock (no processes) ----------

def _stack(tmp_path: Path, **kwargs):  # type: ignore[no-untyped-def]
    from inferlb.components import StackPorts, stack_components

    return stack_components(workers=2, base_port=8101, data_dir=tmp_path, ports=StackPorts(), **kwargs)


@pytest.mark.envoy  # finds the binary to plan the stack
def test_up_starts_workers_control_plane_ext_proc_envoy_in_that_order(tmp_path: Path) -> None:
    from control_plane.__main__ import build_parser as control_plane_parser
    from ext_proc.__main__ import build_parser as ext_proc_parser
    from workers.__main__ import _serve_parser as worker_parser

    components = _stack(tmp_path)
    assert [c.name for c in components] == ["worker:8101", "worker:8102", "control-plane", "ext_proc", "envoy"]
    worker, _, cp, ext, envoy = components
    # every command line is one its service accepts (a renamed flag fails here, not at `make up`)
    assert not worker_parser().parse_args(list(worker.argv[3:])).simulate
    cp_args = control_plane_parser().parse_args(list(cp.argv[3:]))
    assert cp_args.endpoints == ["127.0.0.1:8101", "127.0.0.1:8102"] and cp_args.dataplane is None
    assert ext_proc_parser().parse_args(list(ext.argv[3:])).xds_port == 18000
    assert "-c" in envoy.argv and (tmp_path / "envoy-bootstrap.yaml").exists()
    assert envoy.pre_stop is not None  # Envoy drains before SIGTERM
    assert {c.stop_group for c in components} == {"workers", "control-plane", "ext_proc", "envoy"}
    assert all(c.log_path.parent == tmp_path / "logs" for c in components)


def test_up_in_nginx_mode_runs_no_ext_proc_and_no_envoy(tmp_path: Path) -> None:
    from control_plane.__main__ import build_parser as control_plane_parser
    from workers.__main__ import _serve_parser as worker_parser

    components = _stack(tmp_path, dataplane="nginx", simulate=True)
    assert [c.name for c in components] == ["worker:8101", "worker:8102", "control-plane"]
    assert control_plane_parser().parse_args(list(components[-1].argv[3:])).dataplane == "nginx"
    assert worker_parser().parse_args(list(components[0].argv[3:])).simulate
    with pytest.raises(ValueError, match="dataplane must be one of envoy, nginx"):
        _stack(tmp_path, dataplane="haproxy")


def test_envoys_active_requests_ignore_its_own_admin_request() -> None:
    from inferlb.components import active_requests

    stats = ("http.admin.downstream_rq_active: 1\nhttp.ingress_http.downstream_rq_active: 2\n"
             "http.other.downstream_rq_active: 1\nlistener.x.downstream_cx_active: 5\n")
    assert active_requests(stats) == 3
    assert active_requests("http.admin.downstream_rq_active: 1\n") == 0


def test_the_lock_refuses_a_second_stack_on_one_data_dir(tmp_path: Path) -> None:
    from inferlb.stack_state import StackLock, StackRunning, stack_running

    assert not stack_running(tmp_path)
    with StackLock(tmp_path):
        assert stack_running(tmp_path)
        with pytest.raises(StackRunning, match=f"already running on {tmp_path} \\(pid {os.getpid()}\\)"):
            StackLock(tmp_path).acquire()
    assert not stack_running(tmp_path)  # the file stays, the lock is gone
    with StackLock(tmp_path):
        pass


def test_the_status_file_round_trips_and_renders(tmp_path: Path) -> None:
    from inferlb.stack_state import ComponentStatus, PoolStatus, StackStatus, read_status, write_status
    from inferlb.status import Observed, as_json, render

    stack = StackStatus(supervisor_pid=10, started_at=1000.0, data_dir=str(tmp_path), dataplane="envoy",
                        components=(ComponentStatus("worker:8101", "ready", "http://127.0.0.1:8101/readyz", "w.log",
                                                    pid=11, started_at=1000.0, crashes=2, restarts=2),
                                    ComponentStatus("envoy", "restarting", "http://127.0.0.1:9901/ready", "e.log",
                                                    pid=12, started_at=1100.0)),
                        links={"inference": "http://127.0.0.1:10000/v1/embeddings"},
                        pools=(PoolStatus("default", 1, 4, 3, 3, "hold: at target"),))
    assert read_status(tmp_path) is None
    write_status(tmp_path, stack)
    assert read_status(tmp_path) == stack
    assert [p.name for p in tmp_path.iterdir()] == ["inferlb-up.json"]  # no temp file left
    observed = [Observed(stack.components[0], alive=True, answers=True),
                Observed(stack.components[1], alive=False, answers=False)]
    text = render(stack, observed, now=1130.0)
    assert "worker:8101  ready (crashed 2 times)  11   2m10s   http://127.0.0.1:8101/readyz" in text
    assert "envoy        restarting               12   -       http://127.0.0.1:9901/ready" in text
    assert "http://127.0.0.1:10000/v1/embeddings" in text
    assert "pool default: 3 worker(s), autoscale 1..4, target 3 (hold: at target)" in text
    assert json.loads(as_json(stack, observed, now=1130.0))["pools"] == [
        {"name": "default", "min_workers": 1, "max_workers": 4, "size": 3, "target": 3, "decision": "hold: at target"}]
    assert [o.ok for o in observed] == [True, False]
    assert Observed(stack.components[0], alive=True, answers=False).state_text() == \
        "not answering (crashed 2 times)"


@pytest.mark.subprocess
def test_status_without_a_stack_exits_3(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 3, out.stderr
    assert f"no inferlb stack is running on {tmp_path}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--json", "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 3 and json.loads(out.stdout) == {"running": False, "data_dir": str(tmp_path)}


@pytest.mark.subprocess
def test_up_refuses_an_unknown_dataplane_with_the_choices() -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "up", "--dataplane", "haproxy"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 2
    assert "argument --dataplane: invalid choice: 'haproxy'" in out.stderr


@pytest.mark.envoy  # finds the binary to plan the stack
def test_up_serves_both_model_versions_and_names_the_pool(tmp_path: Path) -> None:
    from inferlb.components import DEFAULT_MODELS, WorkerOptions, worker_component
    from workers.__main__ import _serve_parser as worker_parser

    worker = _stack(tmp_path)[0]
    args = worker_parser().parse_args(list(worker.argv[3:]))
    assert tuple(args.models.split(",")) == DEFAULT_MODELS == ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32")
    assert "--pool" not in worker.argv  # the default pool: the worker's own default
    batch = worker_component(8200, WorkerOptions(tmp_path, pool="batch", models=(), simulate=True))
    args = worker_parser().parse_args(list(batch.argv[3:]))
    assert (args.pool, args.simulate, args.models) == ("batch", True, None)


def test_up_autoscale_flags_become_a_scaler_and_the_control_planes_pool_bounds(tmp_path: Path) -> None:
    from control_plane.config import load_config
    from inferlb.cli import autoscale_plan, build_parser, pool_env

    args = build_parser().parse_args(["up", "--autoscale", "2..5", "--pool", "batch", "--scale-down-cooldown", "10"])
    fixed, settings = autoscale_plan(args)
    assert fixed == 2 and settings is not None
    assert (settings.pool, settings.min_workers, settings.max_workers, settings.scale_up_cooldown_s,
            settings.scale_down_cooldown_s) == ("batch", 2, 5, 5.0, 10.0)
    env = pool_env(settings, downscale_window_s=20.0)
    with pytest.MonkeyPatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        bounds = load_config(None, {}).autoscale.pool_settings()["batch"]
    assert (bounds.min_replicas, bounds.max_replicas, bounds.downscale_window_s) == (2, 5, 20.0)
    assert autoscale_plan(build_parser().parse_args(["up", "--workers", "3"])) == (3, None)


@pytest.mark.subprocess
@pytest.mark.parametrize(("argv", "message"), [
    (["--autoscale", "3..1"], "need 1 <= MIN <= MAX"),
    (["--autoscale", "1..3", "--workers", "2"], "--workers and --autoscale do not go together"),
    (["--autoscale", "two"], "--autoscale takes MIN..MAX"),
    (["--pool", "Batch_1"], "--pool 'Batch_1' must be a Kubernetes name"),
])
def test_up_refuses_bad_autoscale_flags_saying_why(argv: list[str], message: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "up", "--data-dir", str(tmp_path), *argv],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()  # refused before anything started
