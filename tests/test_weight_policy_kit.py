"""The control plane's weight-policy kit (issue 12, item 3): the controller owns its policy's guard, the kit keeps
no module-level state, and one validator (the runtime's) checks built-in and user policies alike. No servers."""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

import pytest

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Telemetry
from control_plane.policies.contract import FleetView
from control_plane.policies.registry import WeightPolicyRegistry
from control_plane.telemetry.scraper import ScrapeOk
from control_plane.xds import SnapshotCache
from inferlb_runtime import plugins
from tests.stack import prometheus_samples, sample

KIT = ("control_plane.policies.contract", "control_plane.policies.builtins", "control_plane.policies.registry",
       "control_plane.policies.guard")
ENDPOINTS = ["127.0.0.1:9001", "127.0.0.1:9002"]


class Raising:
    name = "raising"

    def __init__(self) -> None:
        self.calls = 0

    def compute(self, view: FleetView) -> Mapping[str, int]:
        self.calls += 1
        raise RuntimeError("policy bug")


class Fixed:
    name = "fixed"

    def compute(self, view: FleetView) -> Mapping[str, int]:
        return {e.id: 7 for e in view.endpoints}


def scrape_round() -> dict[str, ScrapeOk]:
    now = time.monotonic()
    return {endpoint: ScrapeOk(now, 0.01, Telemetry(observed_at=now, cpu_utilization=0.5, rps=10, tokens_per_s=1000))
            for endpoint in ENDPOINTS}


def test_a_new_policy_gets_a_new_guard_and_the_metrics_keep_counting() -> None:
    """A policy suspended after failing in a row stays suspended while it is set; the policy that replaces it
    runs at once under a guard of its own; failures of both reach the control plane's metrics."""
    controller: Controller
    metrics = ControlPlaneMetrics(lambda: controller.state)
    failing = Raising()
    controller = Controller(ControlPlaneConfig(endpoints=ENDPOINTS), SnapshotCache(), metrics, policy=failing)
    for _ in range(3):
        controller.on_scrape_results(scrape_round())
    assert controller.guard.suspended and failing.calls == 3
    controller.set_policy(failing)  # the same instance: the same record, still suspended
    controller.on_scrape_results(scrape_round())
    assert controller.guard.suspended and failing.calls == 3

    controller.set_policy(Fixed())
    assert not controller.guard.suspended and controller.guard.failures == {}
    controller.on_scrape_results(scrape_round())
    assert {e.computed_weight for e in controller.state.endpoints} == {7}
    samples = prometheus_samples(metrics.exposition().decode())
    assert sample(samples, "inferlb_cp_policy_failures_total", policy="raising", reason="error") == 3.0

    controller.set_policy(Raising())  # another instance: a clean record, called again, counted again
    controller.on_scrape_results(scrape_round())
    samples = prometheus_samples(metrics.exposition().decode())
    assert sample(samples, "inferlb_cp_policy_failures_total", policy="raising", reason="error") == 4.0


@pytest.mark.parametrize("module", KIT)
def test_the_kit_keeps_no_module_level_mutable_state(module: str) -> None:
    """Guards and policy memory live on instances (the controller's guard, the policy), never in a module."""
    mutable = {name: type(value).__name__ for name, value in vars(importlib.import_module(module)).items()
               if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray))}
    assert mutable == {}


def test_built_in_and_user_policies_are_validated_by_the_runtimes_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """One parameter validator: ``plugins.parse_params`` checks a built-in's params and a user policy's."""
    seen: list[str] = []
    parse = plugins.parse_params

    def spy(where: str, cls: type, raw: Mapping[str, Any] | None) -> Any:
        seen.append(where)
        return parse(where, cls, raw)

    monkeypatch.setattr(plugins, "parse_params", spy)
    registry = WeightPolicyRegistry(plugins.PolicyAllowlist(("examples.policies",)))
    registry.make("capacity", {"max_step": 2})
    registry.make("examples.policies.canary_weights:CanaryWeightPolicy", {"endpoint": ENDPOINTS[0]})
    with pytest.raises(plugins.BadPolicyParams, match="weight policy 'equal': unknown parameter"):
        registry.make("equal", {"x": 1})
    assert seen == ["weight policy 'capacity'", "weight policy 'examples.policies.canary_weights:CanaryWeightPolicy'",
                    "weight policy 'equal'"]


def test_the_registry_holds_its_allowlist() -> None:
    spec = "examples.policies.canary_weights:CanaryWeightPolicy"
    with pytest.raises(plugins.PolicyNotFound, match="not under a module prefix the operator allows"):
        WeightPolicyRegistry().make(spec, {"endpoint": ENDPOINTS[0]})
    allowed = WeightPolicyRegistry(plugins.PolicyAllowlist(("examples.policies",)))
    assert allowed.make(spec, {"endpoint": ENDPOINTS[0]}).name == "canary"
    assert [d["name"] for d in allowed.describe()][:2] == ["capacity", "equal"]
