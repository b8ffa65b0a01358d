"""Worker configuration precedence and validation, and the command lines' --help."""

from __future__ import annotations

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
    ],
)
def test_every_command_has_help(argv: list[str], expect: str) -> None:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout


def test_a_bad_setting_exits_2_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "port must be 1..65535" in out.stderr
