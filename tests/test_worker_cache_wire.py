"""The worker cache through a real worker (int8 and fp32, real ONNX models) over real HTTP.

What the model computed is read from the worker's own counters: ``inferlb_worker_inputs_total`` counts
inputs that went through a batch, ``inferlb_worker_cache_requests_total{result}`` what the cache did with
each input. Vectors are compared as base64, i.e. bit for bit. Every test uses texts of its own, so the
module's shared worker carries no entry from one test into another.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from .conftest import WorkerProcess, running_worker
from .stack import prometheus_samples, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.model]

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
LONG_WORDS = " ".join(["scheduling"] * 300)  # truncated at the model's 256 tokens
_unique = itertools.count()


def texts(n: int, tag: str) -> list[str]:
    """``n`` texts no other test sends."""
    return [f"{tag} sentence {next(_unique)} about caching" for _ in range(n)]


@pytest.fixture(scope="module")
def worker(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with running_worker(data_dir, tmp_path_factory.mktemp("cache-worker"), "--models", f"{INT8},{FP32}") as w:
        yield w


def post(worker: WorkerProcess, inputs: list[str] | str, headers: dict[str, str] | None = None,
         model: str | None = None) -> dict:
    body: dict = {"input": inputs, "encoding_format": "base64"}
    if model is not None:
        body["model"] = model
    response = httpx.post(f"{worker.url}/v1/embeddings", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def counters(worker: WorkerProcess) -> dict[str, float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    samples = prometheus_samples(text)
    found = {result: sample(samples, "inferlb_worker_cache_requests_total", result=result) or 0.0
             for result in ("hit", "miss", "coalesced")}
    found["computed"] = sample(samples, "inferlb_worker_inputs_total") or 0.0
    found["evictions"] = sample(samples, "inferlb_worker_cache_evictions_total") or 0.0
    found["bytes"] = sample(samples, "inferlb_worker_cache_bytes") or 0.0
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in ("hit", "miss", "coalesced", "computed")}


def rows(doc: dict) -> list[str]:
    return [item["embedding"] for item in doc["data"]]


def test_a_request_of_100_with_30_cached_runs_70_through_the_model(worker: WorkerProcess) -> None:
    cached, new = texts(30, "warm"), texts(70, "cold")
    first = post(worker, cached)
    before = counters(worker)
    mixed = cached[:15] + new + cached[15:]
    doc = post(worker, mixed)
    assert delta(before, counters(worker)) == {"hit": 30, "miss": 70, "coalesced": 0, "computed": 70}
    assert rows(doc)[:15] + rows(doc)[85:] == rows(first)  # the first computation's bits
    assert [item["index"] for item in doc["data"]] == list(range(100))
    # usage as if computed: the same as a request that bypasses the cache
    fresh = post(worker, mixed, headers={"Cache-Control": "no-cache"})
    assert doc["usage"] == fresh["usage"] and doc["usage"]["prompt_tokens"] > 0
    assert counters(worker)["bytes"] > 0


def test_a_cached_answer_has_the_fresh_answers_vector_and_usage(worker: WorkerProcess) -> None:
    (text,) = texts(1, "same")
    fresh = post(worker, text)
    before = counters(worker)
    cached = post(worker, text)
    assert delta(before, counters(worker)) == {"hit": 1, "miss": 0, "coalesced": 0, "computed": 0}
    assert cached == fresh


def test_identical_inputs_in_flight_are_computed_once(worker: WorkerProcess) -> None:
    """A request of 100 full-length inputs keeps the model busy; its last input X is short, so it is
    computed after the long ones; three more requests for X arrive meanwhile and join it."""
    (x,) = texts(1, "coalesce")
    longs = [f"{i} {LONG_WORDS}" for i in texts(60, "long")]
    before = counters(worker)
    with ThreadPoolExecutor(4) as pool:
        leader = pool.submit(post, worker, [*longs, x])
        wait_for(lambda: counters(worker)["miss"] - before["miss"] == 61, 60, "the long request to be queued")
        followers = [pool.submit(post, worker, x) for _ in range(3)]
        wait_for(lambda: counters(worker)["coalesced"] - before["coalesced"] == 3, 60,
                 "the three requests for X to join it")
        first = leader.result()
        answers = [f.result() for f in followers]
    assert delta(before, counters(worker)) == {"hit": 0, "miss": 61, "coalesced": 3, "computed": 61}
    assert all(rows(a) == rows(first)[60:] and a["usage"]["prompt_tokens"] == answers[0]["usage"]["prompt_tokens"]
               for a in answers)
    # the same input several times in one request: computed once too
    (y,) = texts(1, "dup")
    before = counters(worker)
    doc = post(worker, [y, y, y])
    assert delta(before, counters(worker)) == {"hit": 0, "miss": 1, "coalesced": 2, "computed": 1}
    assert len(set(rows(doc))) == 1


def test_no_cache_skips_the_lookup_and_no_store_the_store(worker: WorkerProcess) -> None:
    a, b = texts(2, "control")
    post(worker, a)
    before = counters(worker)
    post(worker, a, headers={"Cache-Control": "no-cache"})
    assert delta(before, counters(worker)) == {"hit": 0, "miss": 1, "coalesced": 0, "computed": 1}
    before = counters(worker)
    post(worker, b, headers={"Cache-Control": "no-store"})
    post(worker, b)  # not stored by the no-store request: computed again, and stored now
    post(worker, b)
    assert delta(before, counters(worker)) == {"hit": 1, "miss": 2, "coalesced": 0, "computed": 2}


def test_a_version_never_answers_with_another_versions_vectors(worker: WorkerProcess) -> None:
    (text,) = texts(1, "version")
    int8 = post(worker, text, model=INT8)
    before = counters(worker)
    fp32 = post(worker, text, model=FP32)
    assert delta(before, counters(worker)) == {"hit": 0, "miss": 1, "coalesced": 0, "computed": 1}
    assert fp32["model"] == FP32 and rows(fp32) != rows(int8)
    before = counters(worker)
    assert rows(post(worker, text, model=FP32)) == rows(fp32)
    assert rows(post(worker, text, model=INT8)) == rows(int8)
    assert delta(before, counters(worker)) == {"hit": 2, "miss": 0, "coalesced": 0, "computed": 0}


def test_a_small_cache_evicts_the_least_recently_used(data_dir: Path, tmp_path: Path) -> None:
    entry = 384 * 4 + 4 * 16  # a vector, and room for a key of up to 16 token ids
    with running_worker(data_dir, tmp_path, "--cache-max-bytes", str(2 * entry)) as small:
        a, b, c = texts(3, "lru")
        for text in (a, b, a, c):  # a used again after b: b is the one evicted for c
            post(small, text)
        before = counters(small)
        assert before["evictions"] == 1 and 0 < before["bytes"] <= 2 * entry
        post(small, a)
        post(small, c)
        post(small, b)
        assert delta(before, counters(small)) == {"hit": 2, "miss": 1, "coalesced": 0, "computed": 1}


def test_zero_bytes_turns_the_cache_and_coalescing_off(data_dir: Path, tmp_path: Path) -> None:
    with running_worker(data_dir, tmp_path, "--cache-max-bytes", "0") as off:
        (text,) = texts(1, "off")
        before = counters(off)
        first = post(off, [text, text])
        second = post(off, text)
        assert delta(before, counters(off)) == {"hit": 0, "miss": 0, "coalesced": 0, "computed": 3}
        assert counters(off)["bytes"] == 0
        assert first["usage"] == {"prompt_tokens": 2 * second["usage"]["prompt_tokens"],
                                  "total_tokens": 2 * second["usage"]["total_tokens"]}
