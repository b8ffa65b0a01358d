"""The ``failing`` filter: an endpoint answering mostly errors gets only probe requests (issue 20's 500-fast
worker kept ~20% of the picks: it looked idle and fast to the completion-time scorer)."""

from __future__ import annotations

import random
from collections import Counter

from ext_proc.pick.catalogue import ModelCatalogue
from ext_proc.pick.failing_filter import FailingFilter
from ext_proc.model import EndpointView, RequestView
from inferlb_runtime.pick_chain import FailingParams, chain_spec

REQUEST = RequestView(tokens=10, estimated=False, model=None, inputs=1)


def endpoint(name: str, error_rate: float | None) -> EndpointView:
    telemetry = {} if error_rate is None else {"error_rate": error_rate}
    return EndpointView(id=name, address="127.0.0.1", port=int(name), telemetry=telemetry)


def test_a_failing_endpoint_is_left_out_but_for_probes() -> None:
    fleet = [endpoint("8001", 0.0), endpoint("8002", 1.0), endpoint("8003", None), endpoint("8004", 0.5)]
    f = FailingFilter(FailingParams(probe_share=0.1), rng=random.Random(7))
    f.new_view(fleet, ModelCatalogue())
    assert f.failing == {"8002"}  # over 0.5 only; no telemetry is not failing
    seen = Counter(e.id for _ in range(2000) for e in f.filter(REQUEST, fleet))
    assert seen["8001"] == seen["8003"] == seen["8004"] == 2000
    assert 0 < seen["8002"] < 2000 * 0.2  # the probes: about a tenth of the requests (seeded)


def test_nothing_is_left_out_when_every_candidate_fails_or_none_does() -> None:
    failing = [endpoint("8001", 1.0), endpoint("8002", 0.9)]
    f = FailingFilter(FailingParams(probe_share=0.0))
    f.new_view(failing, ModelCatalogue())
    assert list(f.filter(REQUEST, failing)) == failing  # errors beat no answer at all
    healthy = [endpoint("8001", 0.0)]
    f.new_view(healthy, ModelCatalogue())
    assert f.failing == frozenset() and f.filter(REQUEST, healthy) is healthy  # the fast path: no copy


def test_a_recovered_endpoint_comes_back_with_the_next_view() -> None:
    f = FailingFilter(FailingParams(probe_share=0.0))
    f.new_view([endpoint("8001", 0.0), endpoint("8002", 1.0)], ModelCatalogue())
    assert [e.id for e in f.filter(REQUEST, [endpoint("8001", 0.0), endpoint("8002", 1.0)])] == ["8001"]
    back = [endpoint("8001", 0.0), endpoint("8002", 0.0)]
    f.new_view(back, ModelCatalogue())
    assert [e.id for e in f.filter(REQUEST, back)] == ["8001", "8002"]


def test_every_preset_runs_it_after_the_model_filter() -> None:
    for name in ("least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"):
        filters = [ref.plugin for ref in chain_spec(name, {}).filters]
        assert filters[:2] == ["model", "failing"], (name, filters)
