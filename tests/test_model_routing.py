"""The shared model-routing contract (inferlb_runtime/model_routing.py): rollouts, their encoding, stickiness."""

from __future__ import annotations

from collections import Counter

import pytest

from inferlb_runtime.model_routing import (
    InvalidRollouts,
    Rollout,
    check_model_name,
    decode_rollouts,
    encode_rollouts,
    sticky_bucket,
)

CANARY = Rollout("embed", (("embed-int8", 90), ("embed-fp32", 10)))


def test_a_rollout_survives_its_encoding_and_the_encoding_is_deterministic() -> None:
    blue_green = Rollout("other", (("other-v2", 100),), "user")
    doc = encode_rollouts([blue_green, CANARY])
    assert list(doc) == ["embed", "other"]  # sorted, whatever the order given
    assert doc == encode_rollouts([CANARY, blue_green])
    decoded = decode_rollouts(doc)
    assert decoded["embed"].versions == (("embed-int8", 90.0), ("embed-fp32", 10.0))
    assert decoded["other"] == blue_green


def test_choose_splits_by_the_percentages() -> None:
    assert CANARY.choose(0.0) == "embed-int8"
    assert CANARY.choose(0.8999) == "embed-int8"
    assert CANARY.choose(0.9) == "embed-fp32"
    assert CANARY.choose(0.999999) == "embed-fp32"
    assert CANARY.targets == {"embed-int8", "embed-fp32"}


def test_sticky_buckets_are_stable_per_caller_and_spread_callers() -> None:
    assert sticky_bucket("embed", "key-1") == sticky_bucket("embed", "key-1")
    assert sticky_bucket("embed", "key-1") != sticky_bucket("other", "key-1")
    picks = Counter(CANARY.choose(sticky_bucket("embed", f"key-{i}")) for i in range(4000))
    assert 320 <= picks["embed-fp32"] <= 480  # 10% of 4,000 callers (binomial sd ~19)


@pytest.mark.parametrize("versions, sticky, message", [
    ((), "none", "names no version"),
    ((("a", 50), ("b", 40)), "none", "sum to 100"),
    ((("a", 100), ("a", 0.0)), "none", "twice"),
    ((("a", 0), ("b", 100)), "none", "must be in (0, 100]"),
    ((("a", float("nan")), ("b", 100)), "none", "must be in (0, 100]"),
    ((("embed", 100),), "none", "itself"),
    ((("a b", 100),), "none", "letters, digits"),
    ((("a", 100),), "cookie", "sticky must be one of none, api_key, user"),
])
def test_bad_rollouts_are_refused_saying_why(versions: tuple, sticky: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        Rollout("embed", versions, sticky)  # type: ignore[arg-type]


@pytest.mark.parametrize("doc", [
    [], {"embed": []}, {"embed": {"versions": [{"model": "a"}]}}, {"embed": {"versions": [{"model": "a", "percent": 50}]}},
    {"bad alias": {"versions": [{"model": "a", "percent": 100}]}},
])
def test_a_malformed_table_is_invalid(doc: object) -> None:
    with pytest.raises(InvalidRollouts):
        decode_rollouts(doc)


def test_model_names() -> None:
    assert check_model_name("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    for bad in ("", "-x", "x" * 129, "a\nb", "ü"):
        with pytest.raises(ValueError):
            check_model_name(bad)
