"""The gateway cache's key for a request, and what the request's ``Cache-Control`` allows.

Why a canonical form: two clients sending the same texts with keys in another order, or other whitespace,
ask the same question and must share the answer; anything that changes the output (the model version
that runs, ``encoding_format``, ``truncate``, ``dimensions``; the tenant when tenants are isolated) is in
the key, so a different question never gets another's answer.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import orjson

from inferlb_runtime.cache_control import CACHE_CONTROL_HEADER, CacheDirectives, parse_cache_control

# Body fields (besides ``input``) that change the worker's answer.
OUTPUT_FIELDS = ("encoding_format", "truncate", "dimensions")
CACHEABLE_PATH = "/v1/embeddings"


def directives(headers: Mapping[str, str]) -> CacheDirectives:
    """The request's ``Cache-Control`` directives (``inferlb_runtime.cache_control``)."""
    return parse_cache_control(headers.get(CACHE_CONTROL_HEADER))


def cacheable_request(headers: Mapping[str, str]) -> bool:
    """Only ``POST /v1/embeddings`` answers are cached (the query string is ignored)."""
    return headers.get(":method") == "POST" and headers.get(":path", "").partition("?")[0] == CACHEABLE_PATH


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def request_key(body: bytes, model: str, tenant: str | None) -> bytes | None:
    """sha256 of (model version or alias, canonical input, the output fields present, tenant if isolated);
    None when the body is not a JSON object with an ``input`` (not cacheable: the worker answers its error)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or "input" not in doc:
        return None
    parts: dict[str, Any] = {"model": model, "input": doc["input"]}
    for name in OUTPUT_FIELDS:
        if name in doc:
            parts[name] = doc[name]
    if tenant is not None:
        parts["tenant"] = tenant
    return hashlib.sha256(_canonical(parts)).digest()
