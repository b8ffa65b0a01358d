"""The worked examples in examples/policies/: sticky sessions with bounded load (a scorer of the pick chain)
and a canary at a fixed share (a weight policy). Frozen inputs, no servers; one test runs the canary in the
real control plane with simulated workers."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from random import Random

import pytest

from control_plane.model import Health, Telemetry
from control_plane.policies.contract import EndpointView, FleetView
from control_plane.policies.registry import make_weight_policy
from control_plane.policies.builtins import CapacityWeightPolicy
from examples.policies.canary_weights import CanaryParams, CanaryWeightPolicy, with_canary_share
from examples.policies.sticky_session import SessionAffinity, SessionAffinityParams, stable_hash
from ext_proc.model import Candidate, RequestView
from ext_proc.model import EndpointView as PickEndpoint  # one endpoint as ext_proc sees it
from ext_proc.pick.policies import CompletionTime, MaxScore, Sampler
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from inferlb_runtime.pick_chain import CompletionTimeParams, MaxScoreParams, SampleParams
from inferlb_runtime.plugins import BadPolicyParams, PolicyAllowlist

STICKY = "examples.policies.sticky_session:SessionAffinity"
CANARY = "examples.policies.canary_weights:CanaryWeightPolicy"
EXAMPLES = PolicyAllowlist(("examples.policies",))

# --- sticky sessions: a scorer added to the default chain ---------------------------------------------


def info(i: int, weight: int = 100) -> PickEndpoint:
    return PickEndpoint(id=f"10.0.{i // 250}.{i % 250}:8000", address=f"10.0.{i // 250}.{i % 250}", port=8000,
                        weight=weight)


def candidate(e: PickEndpoint, outstanding_s: float = 0.0, cost_s: float = 0.01) -> Candidate:
    return Candidate(e, cost_s, outstanding_s, int(outstanding_s / cost_s), 0)


def request(session: str | None = None) -> RequestView:
    return RequestView(tokens=16, estimated=False, model=None, inputs=1,
                       headers={"x-session-id": session} if session is not None else {})


FLEET = tuple(info(i) for i in range(1, 7))


class Sticky:
    """The default chain's scorer and picker with SessionAffinity (weight 1) beside it, on given candidates:
    what the chain does after costing."""

    def __init__(self, seed: int = 1, weight_exponent: float = 0.0, fallbacks: int = 2, **params: object) -> None:
        self.affinity = SessionAffinity(SessionAffinityParams(**params))  # type: ignore[arg-type]
        self.default = CompletionTime(CompletionTimeParams(weight_exponent))
        self.picker = MaxScore(MaxScoreParams(fallbacks, seed))

    def rank(self, request: RequestView, candidates: list[Candidate]) -> list[str]:
        totals = [a + b for a, b in zip(self.default.score(request, candidates),
                                        self.affinity.score(request, candidates))]
        return self.picker.pick(request, candidates, totals)


def sticky(**params: object) -> Sticky:
    return Sticky(**params)  # type: ignore[arg-type]


def test_the_same_session_goes_to_the_same_worker_and_sessions_spread() -> None:
    policy = sticky()
    idle = [candidate(e) for e in FLEET]
    homes = {}
    for s in range(300):
        session = f"user-{s}"
        first = policy.rank(request(session), idle)
        assert len(first) == 3 and len(set(first)) == 3
        for _ in range(3):  # the same primary every time, whatever the candidates' order
            assert policy.rank(request(session), list(reversed(idle)))[0] == first[0]
        homes[session] = first[0]
    spread = Counter(homes.values())
    assert set(spread) == {e.id for e in FLEET} and min(spread.values()) > 20  # ~50 each
    # Another instance (another ext_proc replica, another seed) agrees: the hash is stable.
    other = Sticky(seed=99)
    assert all(other.rank(request(s), idle)[0] == home for s, home in homes.items())


def test_losing_a_worker_moves_only_its_sessions() -> None:
    policy = sticky()
    everyone = [candidate(e) for e in FLEET]
    before = {f"s{s}": policy.rank(request(f"s{s}"), everyone)[0] for s in range(300)}
    gone = FLEET[2].id
    fewer = [c for c in everyone if c.endpoint.id != gone]
    after = {s: policy.rank(request(s), fewer)[0] for s in before}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s in before if before[s] == gone}


def test_an_overloaded_sticky_worker_sheds_the_session_until_it_recovers() -> None:
    policy = sticky(load_factor=1.25)
    session = "conversation-42"
    home = policy.rank(request(session), [candidate(e) for e in FLEET])[0]
    # Everyone has some work; the home a bit more, within the bound: still sticky
    # (completion 0.038 s <= 1.25 x the mean 0.0313 s).
    loads = {e.id: 0.02 for e in FLEET}
    loads[home] = 0.028
    within = [candidate(e, loads[e.id]) for e in FLEET]
    assert policy.rank(request(session), within)[0] == home
    # Far over the bound: the default rule (least predicted completion) decides.
    loads[home] = 0.5
    over = [candidate(e, loads[e.id]) for e in FLEET]
    ranked = policy.rank(request(session), over)
    assert ranked[0] != home and home not in ranked
    # Recovered: the session is back home.
    assert policy.rank(request(session), [candidate(e) for e in FLEET])[0] == home


def test_without_a_session_the_default_rule_ranks() -> None:
    policy = sticky(weight_exponent=1.0)
    cands = [candidate(e, outstanding_s=0.1 * (i + 1)) for i, e in enumerate(FLEET)]
    assert policy.rank(request(None), cands) == [FLEET[0].id, FLEET[1].id, FLEET[2].id]
    # Weight counts as capacity (weight_exponent 1): double weight halves the score.
    heavy = [candidate(info(1), 0.1), candidate(info(2, weight=300), 0.2)]
    assert policy.rank(request(None), heavy)[0] == info(2).id
    assert sticky(fallbacks=0).rank(request(None), cands) == [FLEET[0].id]


def test_on_a_large_fleet_the_sample_keeps_the_sessions_favourite() -> None:
    big = tuple(info(i) for i in range(1000))
    affinity = SessionAffinity()
    session = "tenant-7"
    favourite = affinity.preference(session, [e.id for e in big])[0]
    assert [e.id for e in affinity.favourites(request(session), big)] == [favourite]
    sampler = Sampler(SampleParams(d=4), Random(3))
    pool = sampler.sample(big, affinity.favourites(request(session), big))
    assert 4 <= len(pool) <= 5 and len({e.id for e in pool}) == len(pool) and favourite in {e.id for e in pool}
    assert sticky().rank(request(session), [candidate(e) for e in pool])[0] == favourite
    assert affinity.favourites(request(None), big) == [] and len(sampler.sample(big, [])) == 4
    # Through the chain as a spec builds it: only the favourite and a sample are costed, and it stays sticky.
    router = Router(PluginRegistry(EXAMPLES), "least_completion_time", {"seed": 3, "scorers": [{"plugin": STICKY}]})
    for key in range(20):
        decision = router.decide(key, request(session), big)
        assert decision is not None and decision.primary == favourite  # type: ignore[union-attr]
        assert decision.evaluated <= 5  # type: ignore[union-attr]  # the favourite and d = 4
        router.release(key)
    small = FLEET[:4]
    assert sampler.sample(small, affinity.favourites(request(session), small)) is small  # d or fewer: everyone


def test_sticky_through_the_router_loaded_by_spec() -> None:
    router = Router(PluginRegistry(EXAMPLES), "least_completion_time",
                    {"seed": 3, "scorers": [{"plugin": STICKY}]})
    primaries = set()
    for key in range(20):
        decision = router.decide(key, request("abc"), FLEET)
        primaries.add(decision.primary)  # type: ignore[union-attr]
        router.release(key)
    assert len(primaries) == 1
    assert stable_hash("abc") == stable_hash("abc")


def test_sticky_params_are_validated() -> None:
    registry = PluginRegistry(EXAMPLES)

    def build(params: dict) -> object:
        return registry.build("least_completion_time", {"scorers": [{"plugin": STICKY, "params": params}]})

    with pytest.raises(BadPolicyParams, match="load_factor must be in"):
        build({"load_factor": 0.5})
    with pytest.raises(BadPolicyParams, match="lower-case header"):
        build({"header": "X-Session-Id"})
    assert build({"header": "x-user"}).scorers[-1][0].params.header == "x-user"  # type: ignore[attr-defined]


# --- canary ---------------------------------------------------------------------------------------


def ev(i: int, weight: int = 100, *, health: Health = Health.HEALTHY, draining: bool = False,
       tokens_per_s: float | None = None) -> EndpointView:
    telemetry = None if tokens_per_s is None else Telemetry(observed_at=10.0, cpu_utilization=0.5, rps=10.0,
                                                            tokens_per_s=tokens_per_s, latency_per_token_s=0.001)
    return EndpointView(id=f"10.0.0.{i}:8000", health=health, draining=draining, weight=weight,
                        telemetry=telemetry, stale=telemetry is None)


CANARY_ID = "10.0.0.9:8000"


def share_of(weights: Mapping[str, int], view: FleetView, endpoint: str) -> float:
    routable = [e.id for e in view.endpoints if not e.draining and e.health is not Health.UNHEALTHY]
    return weights[endpoint] / sum(weights[i] for i in routable)


def canary(share: float = 0.05) -> CanaryWeightPolicy:
    return CanaryWeightPolicy(CanaryParams(endpoint=CANARY_ID, share=share))


def test_the_canary_gets_its_share_and_the_others_the_capacity_weights() -> None:
    policy, baseline = canary(0.05), CapacityWeightPolicy()
    view = FleetView((ev(1, tokens_per_s=2000.0), ev(2, tokens_per_s=1000.0), ev(3, tokens_per_s=1000.0),
                      ev(9, tokens_per_s=5000.0)), now=10.0)
    for _ in range(10):  # rounds: capacity moves the others' weights step by step
        weights = policy.compute(view)
        expected = baseline.compute(view)
        assert {k: v for k, v in weights.items() if k != CANARY_ID} == \
               {k: v for k, v in expected.items() if k != CANARY_ID}
        assert share_of(weights, view, CANARY_ID) == pytest.approx(0.05, abs=0.005)
        # The next round starts from these weights, as in the control plane.
        view = FleetView(tuple(EndpointView(**{**e.__dict__, "weight": weights[e.id]}) for e in view.endpoints),
                         now=view.now)
    assert weights["10.0.0.1:8000"] > weights["10.0.0.2:8000"]  # the fast worker still gets more


@pytest.mark.parametrize("share", [0.01, 0.05, 0.2, 0.5])
def test_shares_hold_on_idle_fleets_of_any_size(share: float) -> None:
    for size in (1, 2, 5, 40):
        view = FleetView((*(ev(i + 10) for i in range(size)), ev(9)), now=0.0)
        weights = canary(share).compute(view)
        assert all(1 <= w <= 1000 for w in weights.values())
        tolerance = max(0.005, 1 / sum(weights.values()))  # one unit of rounding
        assert share_of(weights, view, CANARY_ID) == pytest.approx(share, abs=tolerance)


def test_weights_are_rescaled_when_the_canary_weight_would_not_fit() -> None:
    heavy = FleetView(tuple(ev(i, weight=1000) for i in range(1, 5)) + (ev(9),), now=0.0)
    weights = with_canary_share(heavy, {e.id: e.weight for e in heavy.endpoints}, CANARY_ID, 0.5)
    assert weights[CANARY_ID] == 1000 and share_of(weights, heavy, CANARY_ID) == pytest.approx(0.5, abs=0.01)
    light = FleetView((ev(1, weight=2), ev(9)), now=0.0)
    weights = with_canary_share(light, {e.id: e.weight for e in light.endpoints}, CANARY_ID, 0.01)
    assert weights[CANARY_ID] == 1 and share_of(weights, light, CANARY_ID) == pytest.approx(0.01, abs=0.001)


@pytest.mark.parametrize("canary_view", [
    ev(9, health=Health.UNHEALTHY), ev(9, draining=True), None,
])
def test_a_canary_that_cannot_take_traffic_leaves_the_capacity_weights(canary_view: EndpointView | None) -> None:
    endpoints = (ev(1, tokens_per_s=2000.0), ev(2, tokens_per_s=1000.0))
    view = FleetView(endpoints + ((canary_view,) if canary_view else ()), now=10.0)
    assert canary().compute(view) == CapacityWeightPolicy().compute(view)


def test_unroutable_others_do_not_count_and_a_lone_canary_keeps_its_weight() -> None:
    view = FleetView((ev(1), ev(2, draining=True), ev(3, health=Health.UNHEALTHY), ev(9)), now=0.0)
    weights = canary(0.2).compute(view)
    assert weights[CANARY_ID] == 25  # 0.2 / 0.8 * 100: only ev(1) is routable
    alone = FleetView((ev(1, draining=True), ev(9, weight=70)), now=0.0)
    assert canary(0.2).compute(alone)[CANARY_ID] == 70


def test_canary_params_are_validated() -> None:
    with pytest.raises(BadPolicyParams, match="endpoint must be host:port"):
        make_weight_policy(CANARY, {"endpoint": "nohost"}, EXAMPLES)
    with pytest.raises(BadPolicyParams, match=r"share must be in \(0, 0.5\]"):
        make_weight_policy(CANARY, {"endpoint": CANARY_ID, "share": 0}, EXAMPLES)
    policy = make_weight_policy(CANARY, {"endpoint": CANARY_ID, "share": 0.1}, EXAMPLES)
    assert isinstance(policy, CanaryWeightPolicy) and policy.params.share == 0.1


# --- through the real control plane ---------------------------------------------------------------


@pytest.mark.servers
@pytest.mark.slow
def test_the_control_plane_runs_the_canary_policy_from_its_command_line(tmp_path: Path) -> None:
    """``python -m control_plane --weight-policy examples.policies.canary_weights:CanaryWeightPolicy`` with three
    simulated workers: /metrics shows the canary's effective weight at its share."""
    from tests.stack import running_control_plane, running_sim_workers, wait_for

    with running_sim_workers(tmp_path, 3) as workers:
        canary_id = workers[0].id
        params = json.dumps({"endpoint": canary_id, "share": 0.1})
        with running_control_plane(tmp_path, endpoints=[w.id for w in workers], weight_policy=CANARY,
                                   env={"INFERLB_CP_WEIGHT_PARAMS": params,
                                        "INFERLB_CP_ALLOWED_POLICY_MODULES": "examples.policies"}) as cp:
            def canary_share() -> float | None:
                weights = cp.effective_weights()
                if len(weights) != 3 or weights[canary_id] == 100:
                    return None
                return weights[canary_id] / sum(weights.values())

            share = wait_for(canary_share, 20, "the canary's weight to reach its share", [cp.proc])
            assert share == pytest.approx(0.1, abs=0.01)
            weights = cp.effective_weights()
            assert weights[canary_id] == 22  # 0.1 / 0.9 * (100 + 100)
