"""Containment of user policies: a weight or pick policy that raises, returns garbage or is slow is replaced
by the default for that round or decision, counted, logged once per interval, and never crashes anything.
No servers: frozen inputs, fake clocks."""

from __future__ import annotations

import logging
import math
import time
from random import Random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Health, Telemetry
from control_plane.policies.contract import EndpointView, FleetView
from control_plane.policies.guard import WeightPolicyGuard
from control_plane.policies.registry import make_weight_policy
from control_plane.telemetry.scraper import ScrapeOk
from control_plane.policies.builtins import CapacityWeightPolicy
from control_plane.xds import SnapshotCache
from ext_proc.pick.cost import CostModel
from ext_proc.metrics import ExtProcMetrics
from ext_proc.pick.chain import PickChain
from ext_proc.pick.guard import GuardedPlugin
from ext_proc.model import Candidate, Decision, RequestView
from ext_proc.model import EndpointView as PickEndpoint  # one endpoint as ext_proc sees it
from ext_proc.pick.policies import Sampler
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from inferlb_runtime.pick_chain import SampleParams
from inferlb_runtime.plugins import PolicyAllowlist
from tests.stack import prometheus_samples, sample


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """A failure observer for both services (the control plane's protocol and ext_proc's callable)."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def policy_failure(self, policy: str, reason: str) -> None:
        self.failures.append((policy, reason))

    __call__ = policy_failure


# --- weight policies ------------------------------------------------------------------------------


def busy(i: int, weight: int = 100, *, tokens_per_s: float = 1000.0, now: float = 10.0) -> EndpointView:
    telemetry = Telemetry(observed_at=now, cpu_utilization=0.5, rps=10.0, tokens_per_s=tokens_per_s,
                          latency_per_token_s=0.001)
    return EndpointView(id=f"10.0.0.{i}:8000", health=Health.HEALTHY, weight=weight, telemetry=telemetry, stale=False)


def fleet_view() -> FleetView:
    # Three workers, one twice as fast: the capacity policy moves weights, so its answer is recognisable.
    return FleetView((busy(1, tokens_per_s=2000.0), busy(2), busy(3)), now=10.0)


class Scripted:
    """A weight policy whose answer (or exception, or time) the test chooses."""

    name = "scripted"

    def __init__(self, answer: Callable[[FleetView], Any], timer: FakeClock | None = None, cost_s: float = 0.0):
        self.answer, self.timer, self.cost_s, self.calls = answer, timer, cost_s, 0

    def compute(self, view: FleetView) -> Any:
        self.calls += 1
        if self.timer is not None:
            self.timer.advance(self.cost_s)
        return self.answer(view)


def raising(view: FleetView) -> Any:
    raise RuntimeError("policy bug")


def ids(view: FleetView) -> list[str]:
    return [e.id for e in view.endpoints]


def guard(policy: Any, **kwargs: Any) -> tuple[WeightPolicyGuard, FakeClock, FakeClock]:
    clock, timer = FakeClock(), kwargs.pop("timer", FakeClock())
    return WeightPolicyGuard(policy, clock=clock, timer=timer, **kwargs), clock, timer


def test_a_raising_weight_policy_gets_the_default_weights_and_is_counted() -> None:
    view = fleet_view()
    g, _, _ = guard(Scripted(raising))
    recorder = Recorder()
    weights = g.compute(view, recorder)
    assert weights == CapacityWeightPolicy().compute(view)  # the default's answer for the round
    assert weights["10.0.0.1:8000"] > weights["10.0.0.2:8000"]
    assert recorder.failures == [("scripted", "error")] and g.failures == {"error": 1}
    assert g.last_used == "capacity"


@pytest.mark.parametrize("answer, reason", [
    (lambda v: None, "bad_type"),
    (lambda v: [100, 100, 100], "bad_type"),
    (lambda v: {**{i: 100 for i in ids(v)}, "10.9.9.9:1": 100}, "unknown_endpoint"),
    (lambda v: {ids(v)[0]: 100}, "missing_endpoint"),
    (lambda v: {i: -5 for i in ids(v)}, "bad_weight"),
    (lambda v: {i: 0 for i in ids(v)}, "bad_weight"),
    (lambda v: {i: 1001 for i in ids(v)}, "bad_weight"),
    (lambda v: {i: math.nan for i in ids(v)}, "bad_weight"),
    (lambda v: {i: math.inf for i in ids(v)}, "bad_weight"),
    (lambda v: {i: 100.5 for i in ids(v)}, "bad_weight"),
    (lambda v: {i: 100.0 for i in ids(v)}, "bad_weight"),
    (lambda v: {i: True for i in ids(v)}, "bad_weight"),
    (lambda v: {i: "100" for i in ids(v)}, "bad_weight"),
])
def test_garbage_weights_are_replaced_by_the_default(answer: Callable[[FleetView], Any], reason: str) -> None:
    view = fleet_view()
    g, _, _ = guard(Scripted(answer))
    recorder = Recorder()
    assert g.compute(view, recorder) == CapacityWeightPolicy().compute(view)
    assert recorder.failures == [("scripted", reason)]


def test_valid_weights_pass_through_as_ints() -> None:
    view = fleet_view()
    g, _, _ = guard(Scripted(lambda v: {i: n for n, i in enumerate(ids(v), start=1)}))
    recorder = Recorder()
    assert g.compute(view, recorder) == {"10.0.0.1:8000": 1, "10.0.0.2:8000": 2, "10.0.0.3:8000": 3}
    assert recorder.failures == [] and g.last_used == "scripted"


def test_a_slow_weight_policy_is_over_budget_then_suspended_for_a_cooldown() -> None:
    view = fleet_view()
    timer = FakeClock()
    policy = Scripted(lambda v: {i: 500 for i in ids(v)}, timer, cost_s=0.2)
    g, clock, _ = guard(policy, timer=timer, budget_s=0.05, max_consecutive=3, cooldown_s=30.0)
    recorder = Recorder()
    default = CapacityWeightPolicy().compute(view)
    for _ in range(3):
        assert g.compute(view, recorder) == default  # its (valid) answer is discarded: it took 200 ms
    assert recorder.failures == [("scripted", "slow")] * 3 and policy.calls == 3
    assert g.suspended
    for _ in range(10):  # suspended: not even called
        g.compute(view, recorder)
    assert policy.calls == 3 and len(recorder.failures) == 3
    clock.advance(31.0)
    policy.cost_s = 0.001  # recovered
    assert g.compute(view, recorder) == {i: 500 for i in ids(view)}
    assert policy.calls == 4 and not g.suspended


def test_a_builtin_policy_is_not_timed() -> None:
    view = fleet_view()
    timer = FakeClock()

    class SlowCapacity(CapacityWeightPolicy):
        def compute(self, view: FleetView) -> Mapping[str, int]:
            timer.advance(1.0)
            return super().compute(view)

    g = WeightPolicyGuard(CapacityWeightPolicy(), timer=timer, budget_s=0.001)
    recorder = Recorder()
    g.compute(view, recorder)
    assert recorder.failures == []
    assert WeightPolicyGuard(SlowCapacity(), timer=timer, budget_s=0.001).budget_s == 0.001  # a subclass is user code


def test_when_the_default_fails_too_weights_are_kept() -> None:
    view = fleet_view()
    g, _, _ = guard(Scripted(raising), default=Scripted(lambda v: {"x": 1}))
    assert g.compute(view, Recorder()) == {i: 100 for i in ids(view)}
    assert g.last_used == "keep"
    # The default policy itself failing (a bug, or parameters it cannot cope with) does not fall back to itself.
    broken = CapacityWeightPolicy()
    broken.compute = raising  # type: ignore[method-assign]
    g2, _, _ = guard(broken)
    assert g2.compute(view, Recorder()) == {i: 100 for i in ids(view)} and g2.last_used == "keep"


def test_failures_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    view = fleet_view()
    g, clock, _ = guard(Scripted(raising), log_interval_s=60.0, max_consecutive=1000)
    with caplog.at_level(logging.ERROR, logger="inferlb.control_plane.policy"):
        for _ in range(5):
            g.compute(view, None)
            clock.advance(1.0)
        lines = [r for r in caplog.records if r.name == "inferlb.control_plane.policy"]
        assert len(lines) == 1 and lines[0].reason == "error" and "policy bug" in lines[0].detail
        clock.advance(60.0)
        g.compute(view, None)
        lines = [r for r in caplog.records if r.name == "inferlb.control_plane.policy"]
        assert len(lines) == 2 and lines[1].similar_failures_not_logged == 4
    assert g.failures == {"error": 6}


def test_guards_are_per_policy_instance() -> None:
    """The controller owns its policy's guard: kept while the policy is, replaced (clean record) when it changes."""
    a, b = Scripted(raising), Scripted(raising)
    controller = Controller(ControlPlaneConfig(endpoints=["127.0.0.1:9001"]), SnapshotCache(), policy=a)
    guard_of_a = controller.guard
    controller.set_policy(a)
    assert controller.guard is guard_of_a and controller.guard.policy is a and controller.policy is a
    controller.set_policy(b)
    assert controller.guard is not guard_of_a and controller.guard.policy is b and controller.policy is b
    assert guard_of_a.compute(fleet_view()) == CapacityWeightPolicy().compute(fleet_view())
    assert controller.guard.compute(fleet_view()) == CapacityWeightPolicy().compute(fleet_view())


def test_the_controller_contains_a_raising_user_policy_and_counts_it() -> None:
    """Through the real call site: a scrape round with a policy that raises keeps the control plane going."""
    config = ControlPlaneConfig(endpoints=["127.0.0.1:9001", "127.0.0.1:9002"])
    controller: Controller
    metrics = ControlPlaneMetrics(lambda: controller.state)
    controller = Controller(config, SnapshotCache(), metrics, policy=Scripted(raising))
    now = time.monotonic()
    results = {
        "127.0.0.1:9001": ScrapeOk(now, 0.01, Telemetry(observed_at=now, cpu_utilization=0.5, rps=10, tokens_per_s=3000)),
        "127.0.0.1:9002": ScrapeOk(now, 0.01, Telemetry(observed_at=now, cpu_utilization=0.5, rps=10, tokens_per_s=1000)),
    }
    for _ in range(2):
        controller.on_scrape_results(results)
    weights = {e.id: e.computed_weight for e in controller.state.endpoints}
    assert weights["127.0.0.1:9001"] > weights["127.0.0.1:9002"]  # the capacity policy's weights
    samples = prometheus_samples(metrics.exposition().decode())
    assert sample(samples, "inferlb_cp_policy_failures_total", policy="scripted", reason="error") == 2.0


def test_a_user_weight_policy_from_a_spec_runs_contained_in_the_controller() -> None:
    config = ControlPlaneConfig(endpoints=["127.0.0.1:9001", "127.0.0.1:9002"],
                                weight_policy="examples.policies.canary_weights:CanaryWeightPolicy",
                                allowed_policy_modules=["examples.policies"],
                                weight_params={"endpoint": "127.0.0.1:9002", "share": 0.2})
    controller = Controller(config, SnapshotCache())
    controller.on_scrape_results({})
    assert {e.id: e.computed_weight for e in controller.state.endpoints} == {"127.0.0.1:9001": 100,
                                                                             "127.0.0.1:9002": 25}


# --- pick-chain plugins ---------------------------------------------------------------------------
# A user plugin runs behind ext_proc's guard (ext_proc/pick/guard.py): when it fails, the rest of the chain (the
# default completion-time scorer) decides that request.


def endpoint(i: int, weight: int = 100) -> PickEndpoint:
    return PickEndpoint(id=f"10.0.0.{i}:8000", address=f"10.0.0.{i}", port=8000, weight=weight)


FLEET = tuple(endpoint(i) for i in range(1, 5))
REQUEST = RequestView(tokens=16, estimated=False, model=None, inputs=1, headers={})


class ScriptedPick:
    """A user scorer whose scores (or exception, or time) the test chooses."""

    name = "scripted_pick"

    def __init__(self, answer: Callable[[Sequence[Candidate]], Any], timer: FakeClock | None = None,
                 cost_s: float = 0.0) -> None:
        self.answer, self.timer, self.cost_s, self.calls = answer, timer, cost_s, 0

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> Any:
        self.calls += 1
        if self.timer is not None:
            self.timer.advance(self.cost_s)
        return self.answer(candidates)


class Picking:
    """A router whose chain is the default plus one guarded user plugin (a scorer weighted 100, so that it
    decides while it works, or a filter)."""

    def __init__(self, plugin: Any, step: str, observer: Any, clock: FakeClock, **guard: Any) -> None:
        self.guarded = GuardedPlugin(plugin, step, observer=observer, clock=clock, **guard)
        self.router = Router(PluginRegistry(), "least_completion_time", {"seed": 1})
        chain = self.router.chain
        filters = (*chain.filters, self.guarded) if step == "filter" else chain.filters
        scorers = (*chain.scorers, (self.guarded, 100.0)) if step == "scorer" else chain.scorers
        self.router.chain = PickChain(chain.policy, chain.admit, filters, Sampler(SampleParams(d=0), Random(1)),
                                      scorers, chain.picker)
        self.outstanding = self.router.outstanding
        self._keys = iter(range(10**9))

    def decide(self, request: RequestView, fleet: Sequence[PickEndpoint]) -> Decision | None:
        key = next(self._keys)
        decision = self.router.decide(key, request, fleet)
        self.router.release(key)
        return decision  # type: ignore[return-value]


def contained(policy: Any, step: str = "scorer", **kwargs: Any) -> tuple[GuardedPlugin, Picking, Recorder, FakeClock]:
    clock, recorder = FakeClock(), Recorder()
    picker = Picking(policy, step, recorder, clock, **kwargs)
    return picker.guarded, picker, recorder, clock


def last(candidates: Sequence[Candidate]) -> list[float]:
    return [1.0 if c is candidates[-1] else 0.0 for c in candidates]


def test_a_working_pick_policy_decides() -> None:
    wrapper, picker, recorder, _ = contained(ScriptedPick(last))
    decision = picker.decide(REQUEST, FLEET)
    assert decision is not None and decision.primary == FLEET[-1].id and decision.policy == "least_completion_time"
    assert recorder.failures == [] and wrapper.failures == {}


def boom(candidates: Sequence[Candidate]) -> Any:
    raise KeyError("x-session-id")


@pytest.mark.parametrize("answer, reason", [
    (boom, "error"),
    (lambda c: None, "bad_type"),
    (lambda c: c[0].endpoint.id, "bad_type"),  # a string is not a list of scores
    (lambda c: [42] * len(c), "bad_type"),  # not in [0, 1]
    (lambda c: [c[0].endpoint] * len(c), "bad_type"),
    (lambda c: [math.nan] * len(c), "bad_type"),
    (lambda c: [1.0], "bad_type"),  # not one per candidate
    (lambda c: [], "bad_type"),
])
def test_a_failing_pick_policy_gets_the_default_decision(answer: Callable[..., Any], reason: str) -> None:
    wrapper, picker, recorder, _ = contained(ScriptedPick(answer))
    picker.outstanding.begin("busy", FLEET[0].id, 256, 1.0)  # the default avoids the busy one
    decision = picker.decide(REQUEST, FLEET)
    assert decision is not None and decision.primary != FLEET[0].id
    assert len(decision.ranked) == 3 and set(decision.ranked) <= {e.id for e in FLEET}
    assert recorder.failures == [("scripted_pick", reason)] and wrapper.failures == {reason: 1}


class SamplingPick:
    """A user filter whose answer the test chooses."""

    name = "scripted_pick"

    def __init__(self, sample: Callable[[Sequence[PickEndpoint]], Any]) -> None:
        self._sample = sample
        self.calls = 0

    def filter(self, request: RequestView, endpoints: Sequence[PickEndpoint]) -> Any:
        self.calls += 1
        return self._sample(endpoints)


@pytest.mark.parametrize("sample_answer, reason", [
    (lambda e: 1 / 0, "error"),
    (lambda e: None, "bad_type"),
    (lambda e: [endpoint(99)], "unknown_endpoint"),  # not offered: its id is unknown to Envoy
    (lambda e: ["10.0.0.1:8000"], "unknown_endpoint"),
    (lambda e: [], "empty"),
])
def test_a_failing_sample_gets_the_default_decision(sample_answer: Callable[..., Any], reason: str) -> None:
    policy = SamplingPick(sample_answer)
    _wrapper, picker, recorder, _ = contained(policy, "filter")
    decision = picker.decide(REQUEST, FLEET)
    assert decision is not None and set(decision.ranked) <= {e.id for e in FLEET} and len(decision.ranked) == 3
    assert recorder.failures == [("scripted_pick", reason)]
    # The next decision is the filter's again.
    policy._sample = lambda e: e[:2]
    decision = picker.decide(REQUEST, FLEET)
    assert decision is not None and set(decision.ranked) == {FLEET[0].id, FLEET[1].id} and policy.calls == 2


def test_a_slow_pick_policy_is_counted_then_suspended_for_a_cooldown() -> None:
    timer = FakeClock()
    policy = ScriptedPick(last, timer, cost_s=0.005)
    wrapper, picker, recorder, clock = contained(policy, timer=timer, budget_s=0.002, max_consecutive=5,
                                                 cooldown_s=30.0)
    for _ in range(4):  # slow, but its scores are valid: used, counted
        assert picker.decide(REQUEST, FLEET).primary == FLEET[-1].id  # type: ignore[union-attr]
    policy.cost_s = 0.0001  # one quick call resets the streak
    picker.decide(REQUEST, FLEET)
    policy.cost_s = 0.005
    for _ in range(5):
        picker.decide(REQUEST, FLEET)
    assert recorder.failures == [("scripted_pick", "slow")] * 9
    assert wrapper.suspended and policy.calls == 10
    picker.outstanding.begin("busy", FLEET[-1].id, 256, 1.0)  # the plugin's favourite, which the default avoids
    for _ in range(20):  # the rest of the chain decides, the plugin is not called
        decision = picker.decide(REQUEST, FLEET)
        assert decision is not None and decision.primary != FLEET[-1].id
    assert policy.calls == 10
    clock.advance(31.0)
    policy.cost_s = 0.0001
    assert picker.decide(REQUEST, FLEET).primary == FLEET[-1].id and policy.calls == 11  # type: ignore[union-attr]


def test_pick_failures_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    _wrapper, picker, recorder, clock = contained(ScriptedPick(boom), log_interval_s=60.0, max_consecutive=10**6)
    with caplog.at_level(logging.ERROR, logger="inferlb.ext_proc.policy"):
        for _ in range(1000):
            assert picker.decide(REQUEST, FLEET) is not None
        clock.advance(61.0)
        picker.decide(REQUEST, FLEET)
    lines = [r for r in caplog.records if r.name == "inferlb.ext_proc.policy"]
    assert len(lines) == 2 and lines[1].similar_failures_not_logged == 999
    assert "KeyError" in lines[0].detail
    assert len(recorder.failures) == 1001


class Booming(ScriptedPick):
    """A user scorer that raises on every call, loadable by spec (``tests.test_policy_containment:Booming``)."""

    def __init__(self) -> None:
        super().__init__(boom)


def test_ext_proc_metrics_count_pick_policy_failures() -> None:
    """The registry hands its failure observer (ext_proc's metrics) to every guard it builds."""
    metrics = ExtProcMetrics()
    registry = PluginRegistry(PolicyAllowlist((__name__,)), observer=metrics.policy_failure)
    router = Router(registry, "least_completion_time", {"scorers": [{"plugin": f"{__name__}:Booming"}]})
    for key in range(3):
        assert router.decide(key, REQUEST, FLEET) is not None
        router.release(key)
    samples = prometheus_samples(metrics.render().decode())
    assert sample(samples, "inferlb_ext_proc_policy_failures_total", policy="scripted_pick", reason="error") == 3


def test_an_observer_that_raises_does_not_break_a_decision() -> None:
    def bad_observer(policy: str, reason: str) -> None:
        raise RuntimeError("metrics down")

    picker = Picking(ScriptedPick(boom), "scorer", bad_observer, FakeClock())
    assert picker.decide(REQUEST, FLEET) is not None


def test_the_default_builtin_weight_policy_spec_and_pick_spec_round_trip() -> None:
    """make_* of a builtin gives the plain builtin (no wrapper, no guard state shared across instances)."""
    assert type(make_weight_policy("capacity")) is CapacityWeightPolicy


# --- through ext_proc's gRPC service ---------------------------------------------------------------


@pytest.mark.servers
def test_ext_proc_contains_a_raising_user_policy_switched_to_by_eds(tmp_path: Any, monkeypatch: Any) -> None:
    """EDS names a chain with a user filter and a user scorer that raise on every call: requests still get a
    pick (the rest of the chain's), the failures are counted, and switching back to a built-in works."""
    import asyncio

    from ext_proc.tokens import TokenCounter
    from ext_proc.xds.client import PickPolicySpec, static_view
    from tests.test_ext_proc_service import PICK, exchange, request_body, request_headers, serving, set_headers

    (tmp_path / "raising_policy.py").write_text(
        "class Raising:\n"
        "    name = 'raising'\n"
        "    def score(self, request, candidates):\n"
        "        raise ZeroDivisionError('bug in a user policy')\n"
        "class RaisingFilter:\n"
        "    name = 'raising_filter'\n"
        "    def filter(self, request, endpoints):\n"
        "        raise KeyError('bug in a user filter')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = (PickEndpoint(f"127.0.0.1:{p}", "127.0.0.1", p) for p in (8101, 8102))
    raising = PickPolicySpec("least_completion_time", {"scorers": [{"plugin": "raising_policy:Raising"}],
                                                       "filters": [{"plugin": "raising_policy:RaisingFilter"}]})

    async def scenario() -> None:
        async with serving(TokenCounter.from_package(), static_view([a, b]),
                           allow=PolicyAllowlist(("raising_policy",))) as h:
            h.source.set(static_view([a, b], raising))
            guarded = [p.name for p in h.servicer.router.chain.plugins if isinstance(p, GuardedPlugin)]
            assert guarded == ["raising_filter", "raising"]
            for _ in range(3):
                call = h.stub.Process()
                await exchange(call, request_headers())
                response = await exchange(call, request_body({"input": "hello"}))
                picks = set_headers(response.request_body.response.header_mutation)[PICK].split(",")
                assert set(picks) == {a.id, b.id}
                call.cancel()
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_policy_failures_total",
                                             {"policy": "raising", "reason": "error"}) == 3
            assert registry.get_sample_value("inferlb_ext_proc_policy_failures_total",
                                             {"policy": "raising_filter", "reason": "error"}) == 3
            assert registry.get_sample_value("inferlb_ext_proc_fallbacks_total", {"reason": "policy_error"}) in (0, None)
            h.source.set(static_view([a, b], PickPolicySpec("round_robin")))
            assert h.servicer.router.policy == "round_robin"

    asyncio.run(scenario())


def test_a_scorers_favourites_cannot_bring_in_an_endpoint_it_was_not_offered() -> None:
    """The sample keeps a scorer's favourites; a made-up one (unknown to Envoy's pick values) must never
    become a candidate: before, it was costed and could be picked, and answering the pick then failed."""
    stranger = endpoint(99)

    class Smuggler:
        name = "smuggler"

        def favourites(self, request: RequestView, endpoints: Sequence[PickEndpoint]) -> list[PickEndpoint]:
            return [stranger]

        def score(self, request: RequestView, candidates: Sequence[Candidate]) -> list[float]:
            return [1.0 if c.endpoint is stranger else 0.0 for c in candidates]

    _wrapper, picker, recorder, _ = contained(Smuggler())
    chain = picker.router.chain  # sample 2 of the 4: the favourites are kept beside them
    picker.router.chain = PickChain(chain.policy, chain.admit, chain.filters, Sampler(SampleParams(d=2), Random(1)),
                                    chain.scorers, chain.picker)
    for _ in range(5):
        decision = picker.decide(REQUEST, FLEET)
        assert decision is not None and stranger.id not in decision.ranked and decision.evaluated == 2
    assert recorder.failures == [("smuggler", "unknown_endpoint")] * 5
