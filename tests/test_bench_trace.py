"""The bench's arrival schedule (rate and distribution, per seed) and its exact-length request texts.

Statistical checks use bounds of several standard deviations on long traces
with fixed seeds: deterministic, and far from the expected values only if the
generator is wrong.
"""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from inferlb.bench.load.scenario import DEFAULT_MIX, LengthBucket, Workload
from inferlb.bench.load.texts import WORDS, bodies_for, embeddings_body, text_with_tokens
from inferlb.bench.load.trace import Trace, build_trace


def test_poisson_mean_rate_is_within_statistical_bounds() -> None:
    rate, duration = 200.0, 500.0  # 100,000 expected arrivals
    trace = build_trace(Workload(), rate, duration, seed=3)
    expected = rate * duration
    assert abs(len(trace) - expected) < 5 * math.sqrt(expected)  # Poisson count: sd = sqrt(mean)
    assert trace.send_at_s[0] >= 0 and trace.send_at_s[-1] < duration
    assert np.all(np.diff(trace.send_at_s) >= 0)


def test_poisson_gaps_are_exponential() -> None:
    rate = 50.0
    trace = build_trace(Workload(), rate, 2000.0, seed=4)
    gaps = np.diff(trace.send_at_s)
    n = gaps.size
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(n)
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1.0) < 0.03  # exponential: coefficient of variation 1 (a regular schedule gives 0)
    # quantiles against the exponential's: q(p) = -ln(1 - p) / rate
    for p in (0.1, 0.5, 0.9, 0.99):
        assert np.quantile(gaps, p) == pytest.approx(-math.log(1 - p) / rate, rel=0.05)
    # no memory: the share of gaps longer than 2/rate among those longer than 1/rate is P(gap > 1/rate)
    long = gaps[gaps > 1 / rate]
    assert np.mean(long > 2 / rate) == pytest.approx(math.exp(-1), abs=0.02)


def test_bursty_sends_nothing_in_off_windows_and_keeps_the_mean_rate() -> None:
    on, off, rate, duration = 0.5, 1.5, 100.0, 1000.0
    trace = build_trace(Workload(arrival="bursty", burst_on_s=on, burst_off_s=off), rate, duration, seed=5)
    phase = np.mod(trace.send_at_s, on + off)
    assert np.all(phase < on)  # nothing while "off"
    expected = rate * duration
    assert abs(len(trace) - expected) < 5 * math.sqrt(expected)
    # during "on" the rate is rate * (on + off) / on: count the first on-window of each cycle
    cycles = int(duration // (on + off))
    per_window = np.bincount((trace.send_at_s // (on + off)).astype(int), minlength=cycles)[:cycles]
    assert per_window.mean() == pytest.approx(rate * (on + off), rel=0.02)
    # and within on-windows the gaps are still exponential
    within = np.diff(trace.send_at_s)[np.diff(trace.send_at_s) < on]
    assert abs(within.std() / within.mean() - 1.0) < 0.05


def test_mix_shares_and_ranges_are_respected() -> None:
    trace = build_trace(Workload(), 100.0, 1000.0, seed=6)
    n = len(trace)
    for i, bucket in enumerate(DEFAULT_MIX):
        chosen = trace.tokens[trace.bucket == i]
        sd = math.sqrt(bucket.share * (1 - bucket.share) / n)  # binomial share
        assert abs(chosen.size / n - bucket.share) < 5 * sd
        assert chosen.min() == bucket.min_tokens and chosen.max() == bucket.max_tokens  # inclusive at both ends
    short = trace.tokens[trace.bucket == 0]
    counts = np.bincount(short - 8, minlength=25)
    assert counts.size == 25 and counts.min() > 0.7 * counts.mean()  # uniform over 8..32, every length drawn


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    w = Workload()
    a, b, c = build_trace(w, 80, 30, seed=9), build_trace(w, 80, 30, seed=9), build_trace(w, 80, 30, seed=10)
    assert np.array_equal(a.send_at_s, b.send_at_s) and np.array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.send_at_s[:50], c.send_at_s[:50])
    # lengths come from their own stream: another mix leaves the arrival times alone
    d = build_trace(Workload(mix=(LengthBucket(1.0, 16, 16),)), 80, 30, seed=9)
    assert np.array_equal(a.send_at_s, d.send_at_s) and set(d.tokens.tolist()) == {16}


def test_trace_is_read_only_and_windows_select_by_schedule() -> None:
    trace = build_trace(Workload(), 50, 10, seed=1)
    assert isinstance(trace, Trace)
    with pytest.raises(ValueError):
        trace.send_at_s[0] = 1.0
    mask = trace.window(3.0)
    assert np.all(trace.send_at_s[mask] >= 3.0) and np.all(trace.send_at_s[~mask] < 3.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate_rps": 0}, "rate_rps"),
    ({"rate_rps": float("nan")}, "rate_rps"),
    ({"duration_s": -1}, "duration_s"),
    ({"seed": -2}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"workload": Workload(mix=(LengthBucket(0.5, 8, 32),))}, "add up to 1"),
    ({"workload": Workload(mix=(LengthBucket(1.0, 32, 8),))}, "mix[0]"),
    ({"workload": Workload(arrival="steady")}, "arrival"),  # type: ignore[arg-type]
    ({"workload": Workload(arrival="bursty", burst_on_s=0)}, "burst_on_s"),
])
def test_bad_input_is_refused_by_name(kwargs: dict, message: str) -> None:
    args = {"workload": Workload(), "rate_rps": 10.0, "duration_s": 5.0, "seed": 1, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_trace(**args)


# --- texts ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    """The model's own tokenizer, set up as the workers use it (no padding, truncation at 256)."""
    from ext_proc.tokens import packaged_tokenizer_path
    from workers.tokenization import load_tokenizer

    return load_tokenizer(packaged_tokenizer_path())


def test_every_word_is_one_wordpiece_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for word in WORDS:
        assert len(tokenizer.encode(word, add_special_tokens=False).ids) == 1, word


@pytest.mark.parametrize("n", [3, 8, 17, 32, 64, 128, 255, 256])
def test_texts_have_exactly_the_requested_token_count(tokenizer, n: int) -> None:  # type: ignore[no-untyped-def]
    for variant in range(4):
        text = text_with_tokens(n, variant)
        assert len(tokenizer.encode(text).ids) == n
    assert text_with_tokens(n, 0) == text_with_tokens(n, 0)
    if n >= 8:  # variants differ (a single word may repeat by chance)
        assert text_with_tokens(n, 0) != text_with_tokens(n, 1)


def test_bodies_are_openai_embeddings_requests(tokenizer) -> None:  # type: ignore[no-untyped-def]
    doc = orjson.loads(embeddings_body(40))
    assert doc["model"] == "all-MiniLM-L6-v2" and len(tokenizer.encode(doc["input"]).ids) == 40
    multi = orjson.loads(embeddings_body(20, 3, inputs=3))
    assert [len(tokenizer.encode(t).ids) for t in multi["input"]] == [20, 20, 20]
    trace = build_trace(Workload(), 40, 5, seed=2)
    bodies = bodies_for(trace.tokens)
    assert len(bodies) == len(trace)
    for body, n in list(zip(bodies, trace.tokens.tolist()))[:40]:
        assert len(tokenizer.encode(orjson.loads(body)["input"]).ids) == n


@pytest.mark.parametrize("bad", [2, 0, 257, True, 8.0])
def test_impossible_token_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="tokens must be an integer"):
        text_with_tokens(bad)  # type: ignore[arg-type]
