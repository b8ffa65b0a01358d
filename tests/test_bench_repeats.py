"""The workload's repeat-rate knob (issue 16): repeats of earlier texts, Zipf by popularity, per seed.

The repeats' count is exact by construction, so the checks are equalities; the Zipf skew is checked
on one long trace with a fixed seed (deterministic).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import orjson
import pytest

from inferlb.bench.load.scenario import DEFAULT_MIX, ScenarioError, Workload, scenario_from_mapping
from inferlb.bench.load.texts import bodies_for
from inferlb.bench.load.trace import _lengths, _poisson, build_trace


def test_without_repeats_the_trace_is_the_one_before_the_knob() -> None:
    """Default repeat_rate 0: the arrivals and lengths of the two-stream derivation, no request repeats."""
    trace = build_trace(Workload(), 60, 30, seed=7)
    arrivals, lengths = (np.random.Generator(np.random.PCG64(s)) for s in np.random.SeedSequence(7).spawn(2))
    send_at = _poisson(arrivals, 60, 30)
    bucket, tokens = _lengths(lengths, Workload(), send_at.size)
    assert np.array_equal(trace.send_at_s, send_at) and np.array_equal(trace.tokens, tokens)
    assert np.array_equal(trace.bucket, bucket) and np.all(trace.repeat_of == -1)
    assert bodies_for(trace.tokens, repeat_of=trace.repeat_of) == bodies_for(trace.tokens)


def test_repeats_are_an_exact_share_of_earlier_fresh_texts_deterministic_by_seed() -> None:
    w = Workload(repeat_rate=0.3, repeat_pool=100)
    trace = build_trace(w, 100, 20, seed=3)
    n = len(trace)
    repeats = np.flatnonzero(trace.repeat_of >= 0)
    assert repeats.size == round(0.3 * n)
    assert trace.repeat_of[0] == -1
    sources = trace.repeat_of[repeats]
    assert np.all(sources < repeats) and np.all(trace.repeat_of[sources] == -1)  # an earlier fresh request
    fresh = np.flatnonzero(trace.repeat_of == -1)
    assert np.array_equal(trace.bucket[sources], trace.bucket[repeats])  # within its own length bucket
    for b, bucket in enumerate(w.mix):  # within the bucket's share of the pool
        pool = fresh[trace.bucket[fresh] == b][:max(1, round(100 * bucket.share))]
        assert set(sources[trace.bucket[repeats] == b].tolist()) <= set(pool.tolist())
    assert np.array_equal(trace.tokens[repeats], trace.tokens[sources])
    again = build_trace(w, 100, 20, seed=3)
    assert np.array_equal(again.repeat_of, trace.repeat_of)
    assert not np.array_equal(build_trace(w, 100, 20, seed=4).repeat_of[:n], trace.repeat_of)
    # the arrivals do not move with the knob
    assert np.array_equal(build_trace(Workload(), 100, 20, seed=3).send_at_s, trace.send_at_s)


@pytest.mark.parametrize("seed", range(1, 9))
def test_the_knob_leaves_the_length_mix_so_repeats_carry_their_share_of_the_work(seed: int) -> None:
    """The bucket sequence is the one without repeats, so 30% repeats are about 30% of the tokens whatever
    length the most popular text has (drawn across buckets, seed 1's repeats carried 25% and seed 4's 45%)."""
    trace = build_trace(Workload(repeat_rate=0.3, repeat_pool=1000), 90, 12, seed=seed)
    assert np.array_equal(trace.bucket, build_trace(Workload(), 90, 12, seed=seed).bucket)
    repeats = trace.repeat_of >= 0
    assert 0.27 <= trace.tokens[repeats].sum() / trace.tokens.sum() <= 0.33


def test_the_most_popular_text_repeats_most() -> None:
    trace = build_trace(Workload(repeat_rate=0.5, repeat_pool=50, repeat_zipf_s=1.1), 200, 50, seed=5)
    counts = Counter(trace.repeat_of[trace.repeat_of >= 0].tolist())
    fresh = np.flatnonzero(trace.repeat_of == -1)
    by_rank = [counts.get(int(i), 0) for i in fresh[:50]]
    assert by_rank[0] == max(by_rank)
    assert sum(by_rank[:5]) > sum(by_rank[25:])  # the head outweighs the tail's half
    flat = Counter(build_trace(Workload(repeat_rate=0.5, repeat_pool=50, repeat_zipf_s=0.01), 200, 50,
                               seed=5).repeat_of.tolist())
    assert max(flat[int(i)] for i in fresh[:1]) < by_rank[0]  # a steeper s concentrates more on rank 1


def test_bodies_repeat_exactly_the_traces_repeats() -> None:
    trace = build_trace(Workload(repeat_rate=0.3, repeat_pool=20), 100, 10, seed=2)
    bodies = bodies_for(trace.tokens, repeat_of=trace.repeat_of)
    fresh = [bodies[i] for i in np.flatnonzero(trace.repeat_of == -1)]
    assert len(set(fresh)) == len(fresh)  # every fresh text differs (only deliberate repeats hit a cache)
    for i in np.flatnonzero(trace.repeat_of >= 0):
        assert bodies[i] == bodies[trace.repeat_of[i]]
    assert len(set(bodies)) == len(fresh)
    doc = orjson.loads(bodies[0])
    assert doc["model"] == "all-MiniLM-L6-v2" and isinstance(doc["input"], str)
    with pytest.raises(ValueError, match="not an earlier one"):
        bodies_for([8, 8], repeat_of=[1, 1])
    with pytest.raises(ValueError, match="entries"):
        bodies_for([8, 8], repeat_of=[-1, 0, 0])


@pytest.mark.parametrize(("workload", "message"), [
    ({"repeat_rate": 1.5}, "repeat_rate"),
    ({"repeat_rate": -0.1}, "repeat_rate"),
    ({"repeat_pool": 0}, "repeat_pool"),
    ({"repeat_zipf_s": 0}, "repeat_zipf_s"),
    ({"repeat_rate": "0.3"}, "repeat_rate"),
])
def test_bad_repeat_settings_are_refused_by_name(workload: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        scenario_from_mapping({"workload": workload})
    if not isinstance(workload.get("repeat_rate"), str):
        with pytest.raises(ValueError, match=message):
            build_trace(Workload(mix=DEFAULT_MIX, **workload), 10, 5, seed=1)


def test_a_scenario_file_sets_the_knob() -> None:
    s = scenario_from_mapping({"workload": {"repeat_rate": 0.3, "repeat_pool": 500, "repeat_zipf_s": 1.2}})
    assert (s.workload.repeat_rate, s.workload.repeat_pool, s.workload.repeat_zipf_s) == (0.3, 500, 1.2)


def test_a_salt_gives_another_traces_fresh_texts() -> None:
    trace = build_trace(Workload(repeat_rate=0.3, repeat_pool=20), 100, 5, seed=2)
    a = bodies_for(trace.tokens, repeat_of=trace.repeat_of, salt=1)
    b = bodies_for(trace.tokens, repeat_of=trace.repeat_of, salt=2)
    assert not set(a) & set(b) and a == bodies_for(trace.tokens, repeat_of=trace.repeat_of, salt=1)
    with pytest.raises(ValueError, match="salt"):
        bodies_for(trace.tokens, repeat_of=trace.repeat_of, salt=-1)
