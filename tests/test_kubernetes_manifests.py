"""deploy/kubernetes (a kustomize base) validated offline: every manifest against the official schemas
(kubernetes-validate, strict), and the cross-references between them and the code (no cluster here)."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from control_plane.autoscale import DESIRED_REPLICAS_METRIC
from control_plane.config import ControlPlaneConfig, DataPlaneConfig
from control_plane.config import load_config as load_control_plane_config
from ext_proc.config import ExtProcConfig
from ext_proc.config import load_config as load_ext_proc_config
from inferlb.bootstrap import render_bootstrap
from workers.config import WorkerConfig
from workers.__main__ import _serve_parser as worker_parser
from workers.config import load_config as load_worker_config

from .conftest import ROOT

BASE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.34"
NAMESPACE = "inferlb"


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


def documents() -> list[dict[str, Any]]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def find(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    matches = [d for d in (docs or documents()) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def env(container: dict[str, Any], **substitutions: str) -> dict[str, str]:
    """Literal env values, with ``$(VAR)`` expanded from ``substitutions`` as the kubelet would."""
    return {e["name"]: re.sub(r"\$\((\w+)\)", lambda m: substitutions[m[1]], e["value"])
            for e in container.get("env", []) if "value" in e}


def port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def check_selectors(docs: list[dict[str, Any]]) -> list[str]:
    """Every Service selects the pods of a Deployment, on a port name those pods declare."""
    problems = []
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        targets = [d for d in deployments
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        if not targets:  # several: the workers' Service selects every pool's Deployment
            problems.append(f"Service {service['metadata']['name']} selects 0 Deployments")
            continue
        for target in targets:
            names = {p["name"] for c in containers(target).values() for p in c.get("ports", [])}
            for p in service["spec"]["ports"]:
                if p["targetPort"] not in names:
                    problems.append(f"Service {service['metadata']['name']} targets missing port {p['targetPort']} "
                                    f"in {target['metadata']['name']}")
    return problems


def worker_deployments(docs: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """pool -> its workers' Deployment (the pods running ``python -m workers``), by the pool they report."""
    pools = {}
    for d in docs or documents():
        if d["kind"] == "Deployment" and "worker" in containers(d):
            pools[load_worker_config(environ=env(containers(d)["worker"])).pool] = d
    return pools


# --- schemas ------------------------------------------------------------------------------------------


def test_kustomization_lists_existing_files_and_nothing_is_left_out() -> None:
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert k["namespace"] == NAMESPACE
    listed = set(k["resources"])
    assert all((BASE / name).is_file() for name in listed)
    assert {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"} == listed


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_strictly(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_rejected() -> None:
    worker = copy.deepcopy(find("Deployment", "inferlb-worker"))
    containers(worker)["worker"]["ports"][0]["containerPort"] = "http"  # a name where a number belongs
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)
    typo = copy.deepcopy(find("Service", "inferlb-worker"))
    typo["spec"]["selecter"] = typo["spec"].pop("selector")  # strict: unknown fields are errors
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)


# --- cross-references -------------------------------------------------------------------------------------


def test_services_select_their_pods_and_ports() -> None:
    docs = documents()
    assert check_selectors(docs) == []
    broken = copy.deepcopy(docs)
    find("Service", "inferlb-worker", broken)["spec"]["selector"] = {"app.kubernetes.io/name": "inferlb-wrker"}
    assert check_selectors(broken) == ["Service inferlb-worker selects 0 Deployments"]


def test_rbac_grants_exactly_reading_endpointslices_to_the_control_plane() -> None:
    role = find("Role", "inferlb-endpointslice-reader")
    assert [(r["apiGroups"], r["resources"], sorted(r["verbs"])) for r in role["rules"]] == [
        (["discovery.k8s.io"], ["endpointslices"], ["get", "list", "watch"])]
    binding = find("RoleBinding", "inferlb-control-plane-endpointslices")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    account = find("ServiceAccount", "inferlb-control-plane")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert find("Deployment", "inferlb-control-plane")["spec"]["template"]["spec"]["serviceAccountName"] == account


def _set_env(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_control_plane_settings_are_valid_and_match_the_services(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = find("Deployment", "inferlb-control-plane")
    container = containers(deployment)["control-plane"]
    values = env(container, POD_NAMESPACE=NAMESPACE)
    for name in values:  # pydantic-settings ignores unknown variables: a typo must not pass silently
        path = name.removeprefix("INFERLB_CP_").lower().split("__")
        fields: Any = ControlPlaneConfig.model_fields
        while len(path) > 1:
            annotation = fields[path.pop(0)].annotation
            if typing.get_origin(annotation) is dict:  # a table of named entries: the name, then the entry's
                path.pop(0)
                annotation = typing.get_args(annotation)[1]
            fields = annotation.model_fields
        assert path[0] in fields, f"{name} is no control-plane setting"
    _set_env(monkeypatch, values)
    config = load_control_plane_config(None, {})
    assert config.kubernetes_service == f"{NAMESPACE}/inferlb-worker"
    worker_service = find("Service", "inferlb-worker")
    assert config.kubernetes_port in {p["name"] for p in worker_service["spec"]["ports"]}
    assert (port(container, "xds"), port(container, "admin")) == (ControlPlaneConfig().xds_port,
                                                                  ControlPlaneConfig().admin_port)
    assert (config.xds_port, config.admin_port) == (port(container, "xds"), port(container, "admin"))
    probes = {container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]}
    assert probes == {"/readyz", "/healthz"}
    service = find("Service", "inferlb-control-plane")
    assert {p["port"] for p in service["spec"]["ports"]} == {config.xds_port, config.admin_port}
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(config.admin_port)
    # Envoy listens where the control plane's LDS says; ext_proc is its sidecar on loopback
    assert config.data_plane.listener_port == DataPlaneConfig().listener_port == port(
        containers(find("Deployment", "inferlb-envoy"))["envoy"], "http")
    assert config.data_plane.listener_address == "0.0.0.0"
    assert config.data_plane.ext_proc_address == "127.0.0.1"


def test_workers_match_the_worker_defaults() -> None:
    deployment = find("Deployment", "inferlb-worker")
    pod = deployment["spec"]["template"]["spec"]
    container = containers(deployment)["worker"]
    config = load_worker_config(environ=env(container))
    command = container["command"]
    assert command[:3] == ["python", "-m", "workers"]
    assert int(command[command.index("--port") + 1]) == port(container, "http") == WorkerConfig().port
    assert config.intra_op_threads == 1 and config.cpus == 1
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # preStop, then SIGTERM and up to shutdown_timeout_s of drain: all inside the grace period
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + config.shutdown_timeout_s


def test_one_deployment_and_one_hpa_per_pool_on_the_pools_signal() -> None:
    docs = documents()
    pools = worker_deployments(docs)
    assert set(pools) == {"default", "batch"}
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpas) == len(pools)
    values = env(containers(find("Deployment", "inferlb-control-plane"))["control-plane"], POD_NAMESPACE=NAMESPACE)
    with pytest.MonkeyPatch.context() as m:
        _set_env(m, values)
        autoscale = load_control_plane_config(None, {}).autoscale
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2"
        [metric] = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == DESIRED_REPLICAS_METRIC
        # AverageValue 1: the HPA's ceil(metric / averageValue) is the signal itself
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        [(label, pool)] = metric["external"]["metric"]["selector"]["matchLabels"].items()
        assert label == "pool"  # the control plane's label (control_plane/metrics.py)
        deployment = pools[pool]
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployment["metadata"]["name"]}
        # the pool's own signal is bounded as its HPA is
        bounds = autoscale.pool_settings().get(pool, autoscale.settings())
        assert (bounds.min_replicas, bounds.max_replicas) == (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])


def test_pools_deployments_select_apart_and_the_workers_service_selects_every_pool() -> None:
    pools = worker_deployments()
    service = find("Service", "inferlb-worker")["spec"]["selector"]
    for pool, deployment in pools.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels and labels["inferlb.io/pool"] == pool
        assert service.items() <= labels.items()
        for other_pool, other in pools.items():  # no Deployment adopts another pool's pods
            if other_pool != pool:
                assert not deployment["spec"]["selector"]["matchLabels"].items() <= \
                    other["spec"]["template"]["metadata"]["labels"].items()
        args = worker_parser().parse_args(containers(deployment)["worker"]["command"][3:])
        assert args.models  # each pool says which versions it serves


def test_envoy_pod_runs_the_rendered_bootstrap_and_ext_proc_as_a_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = find("Deployment", "inferlb-envoy")
    pod = containers(deployment)
    assert set(pod) == {"envoy", "ext-proc"}
    assert pod["envoy"]["image"] == "envoyproxy/envoy:v1.40.0"
    control_plane = find("Service", "inferlb-control-plane")
    xds_port = next(p["port"] for p in control_plane["spec"]["ports"] if p["name"] == "xds")
    bootstrap = find("ConfigMap", "inferlb-envoy-bootstrap")["data"]["bootstrap.yaml"]
    assert bootstrap == render_bootstrap(node_id="inferlb-envoy", node_cluster="inferlb",
                                         xds_address=control_plane["metadata"]["name"], xds_port=xds_port,
                                         admin_port=9901)
    mount = next(m for m in pod["envoy"]["volumeMounts"] if m["name"] == "bootstrap")
    assert pod["envoy"]["args"][:2] == ["-c", f"{mount['mountPath']}/bootstrap.yaml"]
    values = env(pod["ext-proc"], POD_NAME="inferlb-envoy-abc")
    for name in values:
        assert name.removeprefix("INFERLB_EXT_PROC_").lower() in ExtProcConfig.model_fields, name
    _set_env(monkeypatch, values)
    ext_proc = load_ext_proc_config(None, {})
    assert (ext_proc.address, ext_proc.port) == ("127.0.0.1", DataPlaneConfig().ext_proc_port)
    assert (ext_proc.xds_address, ext_proc.xds_port) == (control_plane["metadata"]["name"], xds_port)
    assert ext_proc.node_cluster == DataPlaneConfig().ext_proc_node_cluster


def _pods() -> Iterator[tuple[str, dict[str, Any]]]:
    for d in documents():
        if d["kind"] == "Deployment":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


@pytest.mark.parametrize(("name", "pod"), list(_pods()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_container_runs_as_non_root(name: str, pod: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        user = container.get("securityContext", {}).get("runAsUser", pod["securityContext"].get("runAsUser"))
        assert isinstance(user, int) and user > 0, f"{name}/{container['name']} has no non-root user"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        if container["image"].startswith("inferlb"):
            assert container["image"] == "inferlb:latest"


def test_docs_describe_deployment_and_what_was_not_run() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    for needle in ("kubectl apply -k deploy/kubernetes", DESIRED_REPLICAS_METRIC, "prometheus-adapter",
                   "AverageValue", "not run"):
        assert needle in text, needle
    assert Path(BASE / "kustomization.yaml").exists()
