"""Routing by model (issue 15): the pick chain's ``model`` filter, the catalogue it resolves against, the view
parsed from a hand-built rich EDS, per-version cost fits and the ``slow_start`` filter.

Decisions are made by a real :class:`Router` (registry, chain, costing, cost model) on hand-built views; the
randomness is seeded and the slow start's clock injected, so every count here is deterministic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import struct_pb2

from ext_proc.pick.cost import CostModel
from ext_proc.model import Decision, EndpointView, Reply, RequestView
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from ext_proc.pick.slow_start import SlowStart
from ext_proc.pick.catalogue import EMPTY
from ext_proc.xds.client import FleetView, InvalidResource, parse_load_assignment, static_view
from inferlb_runtime.model_routing import Rollout, encode_rollouts, sticky_bucket
from inferlb_runtime.pick_chain import SlowStartParams

from .test_ext_proc_core import FakeClock

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
FAMILY, ST = "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"
ALIASES = (FAMILY, ST)


def endpoint(n: int, models: tuple[str, ...], aliases: tuple[str, ...] = ALIASES, **kw: object) -> EndpointView:
    return EndpointView(f"10.0.0.{n}:8000", f"10.0.0.{n}", 8000, models=models, model_aliases=aliases, **kw)  # type: ignore[arg-type]


# Two int8 workers, one fp32, and a draining one serving a version nobody else has.
FLEET = (endpoint(1, (INT8,)), endpoint(2, (INT8,)), endpoint(3, (FP32,)),
         endpoint(4, ("old-v1",), ("old",), draining=True))
BY_VERSION = {INT8: {FLEET[0].id, FLEET[1].id}, FP32: {FLEET[2].id}}
CANARY = Rollout(FAMILY, ((INT8, 90.0), (FP32, 10.0)))


def router(view: FleetView, policy: str = "least_completion_time", seed: int = 7) -> Router:
    r = Router(PluginRegistry(), policy, {"seed": seed} if policy != "round_robin" else {})
    r.set_catalogue(view.catalogue)
    return r


def ask(model: str | None, **kw: object) -> RequestView:
    return RequestView(tokens=16, estimated=False, model=model, inputs=1, **kw)  # type: ignore[arg-type]


def decide(r: Router, view: FleetView, request: RequestView, key: int = 1) -> Decision | Reply | None:
    outcome = r.decide(key, request, view.endpoints)
    r.release(key)
    return outcome


def versions_chosen(r: Router, view: FleetView, requests: list[RequestView]) -> Counter[str | None]:
    chosen: Counter[str | None] = Counter()
    for key, request in enumerate(requests):
        outcome = decide(r, view, request, key)
        assert type(outcome) is Decision
        if outcome.version is not None:
            assert set(outcome.ranked) <= BY_VERSION[outcome.version]  # never an endpoint without the version
        chosen[outcome.version] += 1
    return chosen


# --- resolution -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"])
def test_a_version_id_goes_only_to_endpoints_serving_it_whatever_the_policy(policy: str) -> None:
    view = static_view(FLEET)
    r = router(view, policy)
    for key in range(20):
        outcome = decide(r, view, ask(FP32), key)
        assert type(outcome) is Decision and outcome.ranked == (FLEET[2].id,) and outcome.version == FP32
        outcome = decide(r, view, ask(INT8), key)
        assert type(outcome) is Decision and set(outcome.ranked) == BY_VERSION[INT8] and outcome.version == INT8


def test_a_bare_alias_goes_to_endpoints_answering_to_it_and_chooses_no_version() -> None:
    view = static_view((*FLEET, endpoint(5, ("other-model",), ("other",))))
    r = router(view)
    primaries = Counter()
    for key in range(60):
        outcome = decide(r, view, ask(ST), key)
        assert type(outcome) is Decision and outcome.version is None  # the worker picks its first version
        assert set(outcome.ranked) <= {e.id for e in FLEET[:3]}
        primaries[outcome.primary] += 1
    assert set(primaries) == {e.id for e in FLEET[:3]}


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_rollout_splits_its_alias_over_versions_within_tolerance(seed: int) -> None:
    view = static_view(FLEET, rollouts=[CANARY])
    r = router(view, seed=seed)
    canary = 0
    for n in range(1, 2001):  # the low-discrepancy sequence: close to 10% over every run, not only on average
        canary += versions_chosen(r, view, [ask(FAMILY)])[FP32]
        assert abs(canary - 0.1 * n) <= 3, n
    # The alias a rollout does not cover still resolves as a worker alias.
    assert versions_chosen(router(view), view, [ask(ST)] * 10) == {None: 10}


def test_a_blue_green_switch_sends_everything_to_the_new_version() -> None:
    view = static_view(FLEET, rollouts=[Rollout(FAMILY, ((FP32, 100.0),))])
    assert versions_chosen(router(view), view, [ask(FAMILY)] * 50) == {FP32: 50}


def test_a_sticky_rollout_keeps_each_caller_on_one_version_and_spreads_callers() -> None:
    by_key = Rollout(FAMILY, ((INT8, 50.0), (FP32, 50.0)), sticky="api_key")
    view = static_view(FLEET, rollouts=[by_key])
    r = router(view)
    for caller in ("key-a", "key-b", "key-c"):
        expected = by_key.choose(sticky_bucket(FAMILY, caller))
        assert versions_chosen(r, view, [ask(FAMILY, key_id=caller)] * 30) == {expected: 30}
    spread = versions_chosen(r, view, [ask(FAMILY, key_id=f"key-{i}") for i in range(400)])
    assert 150 <= spread[FP32] <= 250  # callers spread by their buckets
    # Without a key the bucket is random: both versions come up.
    assert set(versions_chosen(r, view, [ask(FAMILY)] * 100)) == {INT8, FP32}

    by_user = replace(by_key, sticky="user")
    view = static_view(FLEET, rollouts=[by_user])
    r = router(view)
    expected = by_user.choose(sticky_bucket(FAMILY, "alice"))
    assert versions_chosen(r, view, [ask(FAMILY, user="alice", key_id=f"k{i}") for i in range(30)]) == {expected: 30}


def test_an_unknown_model_is_a_404_in_openai_shape_naming_what_the_fleet_serves() -> None:
    view = static_view(FLEET, rollouts=[Rollout("embed", ((INT8, 100.0),))])
    outcome = decide(router(view), view, ask("gpt-4o"))
    assert type(outcome) is Reply
    assert (outcome.status, outcome.code, outcome.type, outcome.param) == (
        404, "model_not_found", "invalid_request_error", "model")
    assert "'gpt-4o'" in outcome.message
    for name in (INT8, FP32, FAMILY, ST, "embed", "old", "old-v1"):
        assert name in outcome.message


def test_a_known_model_without_a_routable_endpoint_is_a_503() -> None:
    view = static_view(FLEET, rollouts=[Rollout("retired", (("old-v1", 100.0),))])
    r = router(view)
    for model in ("old-v1", "old", "retired"):
        outcome = decide(r, view, ask(model))
        assert type(outcome) is Reply and (outcome.status, outcome.code, outcome.param) == (
            503, "model_unavailable", "model"), model
        assert outcome.retry_after_s == 1 and model in outcome.message


def test_no_model_or_no_catalogue_routes_as_before() -> None:
    view = static_view(FLEET)
    r = router(view)
    primaries = {decide(r, view, ask(None), key).primary for key in range(60)}  # type: ignore[union-attr]
    assert primaries == {e.id for e in FLEET[:3]}  # every routable endpoint, whatever it serves
    # Workers from before model routing say nothing: even a name nobody serves is not refused.
    old = static_view(tuple(replace(e, models=(), model_aliases=()) for e in FLEET))
    assert old.catalogue.empty
    outcome = decide(router(old), old, ask("anything"))
    assert type(outcome) is Decision and outcome.version is None


def test_a_version_served_only_outside_this_replicas_partition_is_still_routed() -> None:
    fleet = tuple(endpoint(i, (INT8,)) for i in range(1, 64)) + (endpoint(64, (FP32,)),)
    view = static_view(fleet)
    fp32 = fleet[-1].id
    for index in (0, 1):
        r = router(view)
        r.set_partition(index, 2)
        outcome = decide(r, view, ask(FP32))
        assert type(outcome) is Decision and outcome.ranked == (fp32,)


# --- the view from a hand-built rich EDS ---------------------------------------------------------------


def rich_eds(rollouts: object, models: object = (INT8,)) -> bytes:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="workers")
    locality = cla.endpoints.add()
    locality.metadata.filter_metadata["inferlb"].update({"rollouts": rollouts})
    for port, (served, pool) in enumerate([(models, "cpu-small"), ([FP32], None)], start=8101):
        lb = locality.lb_endpoints.add()
        lb.endpoint.address.socket_address.address = "127.0.0.1"
        lb.endpoint.address.socket_address.port_value = port
        meta = {"models": served, "model_aliases": [FAMILY, ST, "bad name!"], "queue_depth": 2}
        if pool is not None:
            meta["pool"] = pool
        lb.metadata.filter_metadata["inferlb"].update(meta)
    return cla.SerializeToString()


def test_the_rich_eds_gives_each_endpoint_its_models_and_the_view_its_rollouts() -> None:
    view = parse_load_assignment(rich_eds(encode_rollouts([CANARY])), "workers", "v1")
    a, b = view.endpoints
    assert (a.models, a.model_aliases, a.pool) == ((INT8,), (FAMILY, ST), "cpu-small")  # a bad name left out
    assert (b.models, b.pool) == ((FP32,), "default")
    assert dict(a.telemetry) == {"queue_depth": 2.0}  # names are not telemetry
    assert view.rollouts == {FAMILY: CANARY} and view.rollouts_error is None
    assert view.catalogue.names() == sorted([FP32, INT8, FAMILY, ST])


def test_a_malformed_rollout_table_is_ignored_with_its_reason_and_the_endpoints_kept() -> None:
    bad = {FAMILY: {"versions": [{"model": INT8, "percent": 60}, {"model": FP32, "percent": 60}], "sticky": "none"}}
    for table in (bad, ["not", "a", "table"], {FAMILY: {"versions": "int8"}}):
        view = parse_load_assignment(rich_eds(table), "workers", "v1")
        assert view.rollouts == {} and view.rollouts_error and "rollouts" in view.rollouts_error
        assert len(view.endpoints) == 2 and view.catalogue.versions.keys() == {INT8, FP32}
    assert "sum to 100" in parse_load_assignment(rich_eds(bad), "workers", "v").rollouts_error  # type: ignore[operator]


def test_models_that_are_not_a_list_of_names_are_refused() -> None:
    with pytest.raises(InvalidResource, match="inferlb.models must be a list of strings"):
        parse_load_assignment(rich_eds({}, models="all-MiniLM-L6-v2-int8"), "workers", "v1")


def test_the_models_list_names_versions_aliases_and_rollouts_with_their_split() -> None:
    view = static_view(FLEET, rollouts=[CANARY])
    listed = view.catalogue.models_list(created=123)
    assert listed["object"] == "list"
    by_id = {m["id"]: m for m in listed["data"]}
    assert set(by_id) == {INT8, FP32, FAMILY, ST, "old", "old-v1"}
    assert all(m["object"] == "model" and m["created"] == 123 and m["owned_by"] == "inferlb" for m in by_id.values())
    assert by_id[FAMILY]["inferlb"] == {"kind": "rollout", "rollout": {"versions": {INT8: 90.0, FP32: 10.0},
                                                                      "sticky": "none"}}
    assert by_id[INT8]["inferlb"] == {"kind": "version", "routable_endpoints": 2}
    assert by_id["old-v1"]["inferlb"] == {"kind": "version", "routable_endpoints": 0}
    assert by_id[ST]["inferlb"] == {"kind": "alias", "routable_endpoints": 3}
    assert EMPTY.empty and static_view(FLEET).catalogue.model("nope", 1) is None


# --- per-version cost -------------------------------------------------------------------------------


def test_each_version_on_an_endpoint_gets_its_own_cost_fit_after_a_first_response() -> None:
    cost = CostModel()
    before = cost.predict("e", 256)
    assert cost.predict("e", 256, model=FP32) == before  # nothing learnt for it: the endpoint's estimate
    for _ in range(40):
        cost.observe("e", 256, 0.200, model=FP32)  # fp32: slow
        cost.observe("e", 256, 0.020, model=INT8)  # int8: fast
    fp32, int8, either = cost.predict("e", 256, model=FP32), cost.predict("e", 256, model=INT8), cost.predict("e", 256)
    assert fp32 == pytest.approx(0.200, rel=0.1) and int8 == pytest.approx(0.020, rel=0.1)
    assert int8 < either < fp32  # the endpoint's own fit has seen both
    assert cost.predict("e", 256, model="unseen") == either
    assert cost.observed("e", FP32) == 40 and cost.observed("e") == 80
    cost.retain(set())
    assert cost.observed("e", FP32) == 0


def test_the_costing_predicts_for_the_version_the_model_filter_chose() -> None:
    view = static_view((endpoint(1, (INT8, FP32)),))
    r = router(view)
    for _ in range(40):
        r.learn(view.endpoints[0].id, 16, 0.5, model=FP32)
        r.learn(view.endpoints[0].id, 16, 0.01, model=INT8)
    fp32, int8 = decide(r, view, ask(FP32)), decide(r, view, ask(INT8))
    assert type(fp32) is Decision and type(int8) is Decision
    assert fp32.predicted_s > 10 * int8.predicted_s


# --- slow start -------------------------------------------------------------------------------------


def test_slow_start_ramps_a_new_endpoints_share_over_its_window() -> None:
    clock = FakeClock()
    plugin = SlowStart(SlowStartParams(window_s=10.0, min_share=0.1, seed=3), clock=clock)
    first, joining = FLEET[:2], FLEET[2]
    plugin.new_view(first, EMPTY)
    request = ask(None)
    assert plugin.filter(request, first) is first  # the first view's endpoints were serving: no ramp
    assert plugin.share(first[0].id) == 1.0
    plugin.new_view((*first, joining), EMPTY)
    pool = (*first, joining)

    def kept(n: int = 2000) -> int:
        return sum(joining in plugin.filter(request, pool) for _ in range(n))

    assert plugin.share(joining.id) == pytest.approx(0.1)
    assert 140 <= kept() <= 260  # ~10% of 2,000 (sd ~13)
    clock.now += 5.0
    assert plugin.share(joining.id) == pytest.approx(0.55)
    assert 980 <= kept() <= 1220
    clock.now += 5.0
    assert plugin.share(joining.id) == 1.0
    assert plugin.filter(request, pool) is pool  # the window is over: nothing to do per request
    # Never leaves nothing: a ramping endpoint alone stays a candidate.
    plugin.new_view((FLEET[3],), EMPTY)
    plugin.new_view((FLEET[3], joining), EMPTY)  # it left and came back: it ramps again
    assert plugin.share(joining.id) == pytest.approx(0.1)
    assert all(plugin.filter(request, (joining,)) == (joining,) for _ in range(50))


def test_the_registry_puts_its_one_slow_start_after_the_model_filter_in_every_chain() -> None:
    registry = PluginRegistry.with_slow_start(10.0)
    for policy in ("least_completion_time", "round_robin"):
        names = [f.name for f in registry.build(policy).filters]
        assert names[:2] == ["model", "slow_start"], names
    assert registry.build("round_robin").filters[1] is registry.build("p2c_tokens").filters[1]
    assert [f.name for f in PluginRegistry.with_slow_start(0).build("least_completion_time").filters] == [
        "model", "failing"]
