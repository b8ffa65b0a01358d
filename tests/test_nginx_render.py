"""The NGINX data plane's pure half: quantised weights, server lines, deterministic config text.

No network. The last tests run the real ``nginx -t`` on rendered files (it only parses them).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from control_plane.config import load_config
from control_plane.model import DataPlaneSettings, Endpoint, FleetState, Health, Telemetry
from control_plane.nginx.config import NginxConfig
from control_plane.nginx.model import EXTRA_FILE, MAIN_FILE, UPSTREAMS_FILE, NginxSettings
from control_plane.nginx.process import validate
from control_plane.nginx.quantise import quantise
from control_plane.nginx.render import duration, host_port, render, upstream_servers


def ep(port: int, weight: int = 100, **changes: object) -> Endpoint:
    return dataclasses.replace(Endpoint("127.0.0.1", port, computed_weight=weight), **changes)


def settings(tmp: Path = Path("/srv/inferlb/nginx"), **changes: object) -> NginxSettings:
    return dataclasses.replace(NginxSettings(config_dir=tmp), **changes)


def state(*endpoints: Endpoint) -> FleetState:
    return FleetState(endpoints=endpoints)


# --- quantise -------------------------------------------------------------------------------------


def test_quantise_scales_to_the_heaviest_endpoint() -> None:
    assert quantise({"a": 300, "b": 100, "c": 1}, 20) == {"a": 20, "b": 7, "c": 1}


def test_quantise_leaves_out_weight_zero_and_refuses_zero_levels() -> None:
    assert quantise({"a": 0, "b": 50}, 10) == {"b": 10}
    assert quantise({"a": 0}, 10) == {}
    with pytest.raises(ValueError, match="levels"):
        quantise({"a": 1}, 0)


def test_quantise_holds_a_level_against_small_moves() -> None:
    # b's raw level 7.5 rounds to 8, but nginx runs 7 and 7.5 is within 0.5 + 0.3 of it: no change.
    assert quantise({"a": 200, "b": 75}, 20, previous={"a": 20, "b": 7}, hysteresis=0.3) == {"a": 20, "b": 7}
    # raw 8.4 is 1.4 away: it moves.
    assert quantise({"a": 200, "b": 84}, 20, previous={"a": 20, "b": 7}, hysteresis=0.3)["b"] == 8


def test_quantise_applies_pins_exactly() -> None:
    out = quantise({"a": 200, "b": 75}, 20, previous={"a": 20, "b": 7}, hysteresis=0.3, exact={"b"})
    assert out["b"] == 8


# --- server lines ---------------------------------------------------------------------------------


def test_drained_unhealthy_and_unknown_endpoints() -> None:
    servers = upstream_servers(state(ep(8101), ep(8102, draining=True), ep(8103, health=Health.UNHEALTHY),
                                     ep(8104, health=Health.HEALTHY)), settings())
    by_id = {s.endpoint_id: s for s in servers}
    assert [s.endpoint_id for s in servers] == sorted(by_id)
    assert not by_id["127.0.0.1:8101"].down  # not scraped yet: routable, like in Envoy mode
    assert by_id["127.0.0.1:8102"].down and by_id["127.0.0.1:8103"].down
    assert by_id["127.0.0.1:8104"].weight == 20


def test_pinned_weights_beat_computed_ones() -> None:
    servers = upstream_servers(state(ep(8101, 500, pinned_weight=300), ep(8102, 900, pinned_weight=100)),
                               settings())
    assert [(s.weight, s.pinned) for s in servers] == [(20, True), (7, True)]


# --- the config text --------------------------------------------------------------------------------


def test_same_state_same_bytes_and_telemetry_changes_nothing() -> None:
    a = state(ep(8101, 300), ep(8102, 100))
    b = dataclasses.replace(a, endpoints=tuple(dataclasses.replace(e, telemetry=Telemetry(observed_at=5.0, rps=3))
                                               for e in a.endpoints))
    assert render(a, settings()).files == render(a, settings()).files
    assert render(a, settings()).digest == render(b, settings()).digest


def test_a_real_weight_change_changes_the_digest() -> None:
    before = render(state(ep(8101, 300), ep(8102, 100)), settings())
    after = render(state(ep(8101, 100), ep(8102, 300)), settings(), previous=before.weights)
    assert after.digest != before.digest
    assert "server 127.0.0.1:8101 weight=7 " in after.files[UPSTREAMS_FILE]


def test_upstream_block_has_health_and_keepalive() -> None:
    text = render(state(ep(8101), ep(8102, draining=True)),
                  settings(max_fails=5, fail_timeout_s=7, keepalive=16, keepalive_timeout_s=30)).files[UPSTREAMS_FILE]
    assert "server 127.0.0.1:8101 weight=20 max_fails=5 fail_timeout=7s;" in text
    assert "server 127.0.0.1:8102 down;" in text
    assert "keepalive 16;" in text and "keepalive_timeout 30000ms;" in text
    assert 'map "" $inferlb_routable { default 1; }' in text
    assert "keepalive" not in render(state(ep(8101)), settings(keepalive=0)).files[UPSTREAMS_FILE]


def test_no_routable_endpoint_answers_503_itself() -> None:
    empty = render(state(), settings())
    assert "server 127.0.0.1:1 down;" in empty.files[UPSTREAMS_FILE]
    assert "default 0;" in empty.files[UPSTREAMS_FILE] and not empty.routable
    drained = render(state(ep(8101, draining=True)), settings())
    assert "default 0;" in drained.files[UPSTREAMS_FILE]
    assert "return 503" in drained.files[MAIN_FILE]


def test_main_config_keeps_every_path_under_the_config_dir() -> None:
    main = render(state(ep(8101)), settings(listen_port=10123, read_timeout_s=1.5)).files[MAIN_FILE]
    assert "listen 127.0.0.1:10123;" in main
    assert "pid /srv/inferlb/nginx/nginx.pid;" in main
    assert "error_log /srv/inferlb/nginx/error.log warn;" in main
    assert "proxy_temp_path /srv/inferlb/nginx/temp/proxy;" in main
    assert "proxy_read_timeout 1500ms;" in main
    assert "/etc/nginx" not in main and "/var/" not in main
    assert f"include {UPSTREAMS_FILE};" in main and f"include {EXTRA_FILE};" in main


def test_extra_directives_inline_and_from_the_file() -> None:
    extra = render(state(ep(8101)), settings(extra_directives="add_header X-A 1;"),
                   extra_file_text="add_header X-B 2;\n").files[EXTRA_FILE]
    assert extra.splitlines()[1:] == ["add_header X-A 1;", "add_header X-B 2;"]


def test_ipv6_endpoints_and_listener_are_bracketed() -> None:
    assert host_port("::1:8101") == "[::1]:8101" and host_port("10.0.0.1:80") == "10.0.0.1:80"
    main = render(state(), settings(listen_address="::1")).files[MAIN_FILE]
    assert "listen [::1]:10000;" in main
    assert duration(0.0001) == "1ms"


# --- settings -----------------------------------------------------------------------------------------


def test_settings_fall_back_to_the_data_plane_listener(tmp_path: Path) -> None:
    s = NginxConfig().settings(tmp_path, DataPlaneSettings(listener_address="127.0.0.2", listener_port=10555))
    assert (s.listen_address, s.listen_port, s.config_dir) == ("127.0.0.2", 10555, tmp_path / "nginx")
    assert s.pid_path == tmp_path / "nginx" / "nginx.pid"
    assert NginxConfig(listen_port=9000).settings(tmp_path, DataPlaneSettings()).listen_port == 9000


def test_environment_enables_nginx_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLB_CP_NGINX__ENABLED", "true")
    monkeypatch.setenv("INFERLB_CP_NGINX__WEIGHT_LEVELS", "8")
    config = load_config(None, {"nginx": {"min_reload_interval_s": 5}})
    assert config.nginx.enabled and config.nginx.weight_levels == 8 and config.nginx.min_reload_interval_s == 5


def test_unknown_nginx_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="bogus"):
        NginxConfig(bogus=1)  # type: ignore[call-arg]


# --- the real nginx -t -------------------------------------------------------------------------------------


def _write(directory: Path, files: dict[str, str]) -> None:
    (directory / "temp").mkdir(parents=True, exist_ok=True)  # nginx creates the temp dirs, not their parent
    for name, text in files.items():
        (directory / name).write_text(text)


needs_nginx = pytest.mark.nginx  # skipped, or failed under make test, without nginx (tests/conftest.py)


@needs_nginx
def test_rendered_configs_pass_nginx_t(tmp_path: Path) -> None:
    s = NginxConfig().settings(tmp_path, DataPlaneSettings(listener_port=10999))
    for fleet in (state(), state(ep(8101, 300), ep(8102, 100, draining=True), dataclasses.replace(
            Endpoint("::1", 8103), health=Health.UNHEALTHY))):
        _write(s.config_dir, dict(render(fleet, s).files))
        assert asyncio.run(validate(s, s.main_path)) is None


@needs_nginx
def test_nginx_t_names_a_bogus_directive(tmp_path: Path) -> None:
    s = dataclasses.replace(NginxConfig().settings(tmp_path, DataPlaneSettings()), extra_directives="bogus_thing on;")
    _write(s.config_dir, dict(render(state(ep(8101)), s).files))
    error = asyncio.run(validate(s, s.main_path))
    assert error is not None and 'unknown directive "bogus_thing"' in error
