"""Control-plane settings: file < environment < flags, and bad values refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from control_plane.config import load_config

from .conftest import ROOT


def test_file_environment_and_flags_merge_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "inferlb.toml"
    path.write_text(
        "[control_plane]\nendpoints = ['127.0.0.1:8101', '127.0.0.1:8102']\nscrape_interval_s = 0.25\n"
        "[control_plane.data_plane]\nlistener_port = 10001\nretries = 1\n"
    )
    monkeypatch.setenv("INFERLB_CP_SCRAPE_INTERVAL_S", "0.3")
    monkeypatch.setenv("INFERLB_CP_DATA_PLANE__RETRIES", "3")
    config = load_config(path, {"xds_port": 18001, "endpoints": None})
    assert config.endpoints == ["127.0.0.1:8101", "127.0.0.1:8102"]  # file (the flag was not given)
    assert config.scrape_interval_s == 0.3  # env beats file
    assert config.xds_port == 18001  # flag
    settings = config.data_plane.settings()
    assert settings.listener_port == 10001 and settings.retries == 3


def test_endpoints_from_the_environment_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLB_CP_ENDPOINTS", "127.0.0.1:1, 127.0.0.1:2")
    assert load_config().endpoints == ["127.0.0.1:1", "127.0.0.1:2"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"endpoints": ["127.0.0.1:0"]}, "not host:port"),
        ({"endpoints": ["nohost"]}, "not host:port"),
        ({"endpoints": ["127.0.0.1:1", "127.0.0.1:1"]}, "listed twice"),
        ({"xds_port": 70000}, "xds_port"),
        ({"scrape_interval_s": 0}, "scrape_interval_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_settings_are_refused_by_name(overrides: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        load_config(overrides=overrides)


@pytest.mark.subprocess
def test_the_command_line_explains_itself_and_refuses_bad_input() -> None:
    help_out = subprocess.run([sys.executable, "-m", "control_plane", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    assert help_out.returncode == 0 and "xDS control plane" in help_out.stdout
    bad = subprocess.run([sys.executable, "-m", "control_plane", "--weight-policy", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_requiring_api_keys_makes_envoy_fail_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that skipped ext_proc would skip the key check: with keys required Envoy never fails open."""
    assert load_config(None, {}).data_plane.settings().ext_proc.failure_mode_allow is True
    monkeypatch.setenv("INFERLB_CP_DATA_PLANE__REQUIRE_API_KEYS", "true")
    assert load_config(None, {}).data_plane.settings().ext_proc.failure_mode_allow is False
