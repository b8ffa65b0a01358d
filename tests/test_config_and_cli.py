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


def test_a_bad_setting_exits_2_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--port", "0"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == 2
    assert "port must be 1..65535" in out.stderr


# --- `inferlb up` / `inferlb status`: command lines, the status file and the lock (no processes) ----------

def _stack(tmp_path: Path, **kwargs):  # type: ignore[no-untyped-def]
    from inferlb.components import StackPorts, stack_components

    return stack_components(workers=2, base_port=8101, data_dir=tmp_path, ports=StackPorts(), **kwargs)


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
    from inferlb.stack_state import ComponentStatus, StackStatus, read_status, write_status
    from inferlb.status import Observed, render

    stack = StackStatus(supervisor_pid=10, started_at=1000.0, data_dir=str(tmp_path), dataplane="envoy",
                        components=(ComponentStatus("worker:8101", "ready", "http://127.0.0.1:8101/readyz", "w.log",
                                                    pid=11, started_at=1000.0, crashes=2, restarts=2),
                                    ComponentStatus("envoy", "restarting", "http://127.0.0.1:9901/ready", "e.log",
                                                    pid=12, started_at=1100.0)),
                        links={"inference": "http://127.0.0.1:10000/v1/embeddings"})
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
    assert [o.ok for o in observed] == [True, False]
    assert Observed(stack.components[0], alive=True, answers=False).state_text() == \
        "not answering (crashed 2 times)"


def test_status_without_a_stack_exits_3(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 3, out.stderr
    assert f"no inferlb stack is running on {tmp_path}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--json", "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 3 and json.loads(out.stdout) == {"running": False, "data_dir": str(tmp_path)}


def test_up_refuses_an_unknown_dataplane_with_the_choices() -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "up", "--dataplane", "haproxy"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 2
    assert "argument --dataplane: invalid choice: 'haproxy'" in out.stderr
