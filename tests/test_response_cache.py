"""The gateway cache's parts (issue 16): its key, the request's Cache-Control, and the in-process level (LRU by
bytes, TTL, versions dropped when the catalogue changes)."""

from __future__ import annotations

import pytest

from ext_proc.cache.key import cacheable_request, directives, request_key
from inferlb_runtime.cache_control import CacheDirectives
from ext_proc.cache.memory_store import ENTRY_OVERHEAD_BYTES, CachedResponse, ResponseCache

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"


def test_the_same_question_in_another_spelling_has_the_same_key() -> None:
    a = request_key(b'{"model": "x", "input": ["a b", "c"], "encoding_format": "float"}', INT8, None)
    b = request_key(b'{ "encoding_format":"float","input":[ "a b" ,"c" ],"model":"y" }', INT8, None)
    assert a is not None and a == b  # the body's model is not in the key: the version resolved from it is
    nested = request_key(b'{"input": [[1, 2], [3]], "truncate": {"b": 1, "a": 2}}', INT8, None)
    assert nested == request_key(b'{"truncate": {"a": 2, "b": 1}, "input": [[1,2],[3]]}', INT8, None)


@pytest.mark.parametrize("other, version, tenant", [
    (b'{"input": "hello", "encoding_format": "base64"}', INT8, None),
    (b'{"input": "hello", "truncate": false}', INT8, None),
    (b'{"input": "hello", "dimensions": 128}', INT8, None),
    (b'{"input": "hello "}', INT8, None),  # whitespace inside a text is the text
    (b'{"input": ["hello"]}', INT8, None),  # a list of one is another shape of answer
    (b'{"input": "hello"}', FP32, None),
    (b'{"input": "hello"}', INT8, "acme"),
])
def test_what_changes_the_answer_changes_the_key(other: bytes, version: str, tenant: str | None) -> None:
    assert request_key(b'{"input": "hello"}', INT8, None) != request_key(other, version, tenant)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"model": "x"}', b"\"hello\""])
def test_a_body_without_a_usable_input_is_not_cacheable(body: bytes) -> None:
    assert request_key(body, INT8, None) is None


def test_cache_control_and_which_requests_are_cacheable() -> None:
    assert directives({}) == CacheDirectives()
    assert directives({"cache-control": "No-Cache"}) == CacheDirectives(no_cache=True)
    assert directives({"cache-control": "max-age=0, no-store"}) == CacheDirectives(no_store=True)
    assert cacheable_request({":method": "POST", ":path": "/v1/embeddings?x=1"})
    assert not cacheable_request({":method": "GET", ":path": "/v1/embeddings"})
    assert not cacheable_request({":method": "POST", ":path": "/v1/other"})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answer(size: int, version: str = INT8) -> CachedResponse:
    return CachedResponse(b"x" * size, "application/json", version)


def test_least_recently_used_entries_leave_first_to_keep_the_byte_bound() -> None:
    one = answer(1000).size + 32  # a key is 32 bytes (sha256)
    cache = ResponseCache(3 * one, 60, 10 * one, clock=Clock())
    for key in (b"a" * 32, b"b" * 32, b"c" * 32):
        assert cache.put(key, answer(1000))
    assert cache.bytes == 3 * one
    assert cache.get(b"a" * 32) is not None  # a is now the most recently used
    assert cache.put(b"d" * 32, answer(1000))
    assert cache.get(b"b" * 32) is None and cache.get(b"a" * 32) is not None
    assert cache.evictions == 1 and cache.bytes == 3 * one and len(cache) == 3
    assert not cache.put(b"e" * 32, answer(4 * one))  # over the bound (the per-entry cap is the bound)
    assert cache.fits(1000) and not cache.fits(3 * one)


def test_an_entry_expires_after_its_ttl() -> None:
    clock = Clock()
    cache = ResponseCache(1 << 20, 30, 1 << 20, clock=clock)
    cache.put(b"k", answer(10))
    clock.now += 29.9
    assert cache.get(b"k") == answer(10)
    clock.now += 0.1
    assert cache.get(b"k") is None and cache.bytes == 0 and cache.evictions == 0


def test_a_version_gone_from_the_catalogue_takes_its_answers_with_it() -> None:
    cache = ResponseCache(1 << 20, 30, 1 << 20, clock=Clock())
    cache.put(b"old", answer(10, FP32))
    cache.put(b"new", answer(10, INT8))
    assert cache.retain_versions({INT8}) == 1
    assert cache.get(b"old") is None and cache.get(b"new") is not None
    assert cache.bytes == answer(10).size + 3 and ENTRY_OVERHEAD_BYTES > 0
