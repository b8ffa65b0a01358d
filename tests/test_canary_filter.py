"""The canary example as a filter of the pick chain (examples/policies/canary.py), loaded by spec into a
router as ext_proc would load it."""

from __future__ import annotations

from collections import Counter

import pytest

from examples.policies.canary import CanaryFilter, CanaryParams
from ext_proc.model import Decision, EndpointView, RequestView
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from inferlb_runtime.plugins import BadPolicyParams, PolicyAllowlist

SPEC = "examples.policies.canary:CanaryFilter"
EXAMPLES = PolicyAllowlist(("examples.policies",))
FLEET = tuple(EndpointView(f"10.0.0.{i}:8000", f"10.0.0.{i}", 8000) for i in range(1, 6))
CANARY = FLEET[4].id
REQUEST = RequestView(tokens=16, estimated=False, model=None, inputs=1)


def router(share: float, seed: int = 7) -> Router:
    return Router(PluginRegistry(EXAMPLES), "least_completion_time", {"seed": seed, "filters": [
        {"plugin": SPEC, "params": {"endpoint": CANARY, "share": share, "seed": seed}}]})


def primaries(r: Router, fleet: tuple[EndpointView, ...], n: int) -> Counter[str]:
    picks: Counter[str] = Counter()
    for key in range(n):
        decision = r.decide(key, REQUEST, fleet)
        assert type(decision) is Decision
        picks[decision.primary] += 1
        r.release(key)
    return picks


def test_the_canary_gets_its_share_of_the_picks_and_no_fallback_elsewhere() -> None:
    r = router(0.1)
    picks: Counter[str] = Counter()
    for key in range(4000):
        decision = r.decide(key, REQUEST, FLEET)
        assert type(decision) is Decision
        if decision.primary == CANARY:
            assert decision.ranked == (CANARY,)  # a canary request is the canary's alone
        else:
            assert CANARY not in decision.ranked
        picks[decision.primary] += 1
        r.release(key)
    assert 320 <= picks[CANARY] <= 480  # 10% of 4,000 (binomial sd ~19)
    assert set(picks) == {e.id for e in FLEET}


def test_a_canary_that_cannot_take_traffic_splits_nothing() -> None:
    drained = tuple(EndpointView(e.id, e.address, e.port, draining=e.id == CANARY) for e in FLEET)
    picks = primaries(router(0.5), drained, 400)
    assert CANARY not in picks and len(picks) == 4
    alone = (FLEET[4],)
    assert primaries(router(0.1), alone, 50) == {CANARY: 50}  # the only candidate: no split


def test_canary_params_are_validated() -> None:
    registry = PluginRegistry(EXAMPLES)
    for params, message in (({"endpoint": "nohost", "share": 0.1}, "host:port"),
                            ({"endpoint": CANARY, "share": 0.9}, "share must be in"),
                            ({"share": 0.1}, "missing required parameter")):
        with pytest.raises(BadPolicyParams, match=message):
            registry.build("least_completion_time", {"filters": [{"plugin": SPEC, "params": params}]})
    assert CanaryFilter(CanaryParams(CANARY)).params.share == 0.05
