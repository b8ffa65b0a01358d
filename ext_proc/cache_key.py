"""The gateway cache's key for a request, and what the request's ``Cache-Control`` allows.

Why a canonical form: two clients sending the same texts with keys in another order, or other whitespace,
ask the same question and must share the answer; anything that changes the output (the model version
that runs, ``encoding_format``, ``truncate``, ``dimensions``; the tenant when tenants are isolated) is in
the key, so a different question never gets another's answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import orjson

# Body fields (besides ``input``) that change the worker's answer.
OUTPUT_FIELDS = ("encoding_format", "truncate", "dimensions")
CACHE_CONTROL_HEADER = "cache-control"
CACHEABLE_PATH = "/v1/embeddings"


@dataclass(frozen=True)
class Directives:
    """A request's cache directives: ``no_cache`` skips the lookup (the fresh answer may be stored),
    ``no_store`` skips both."""

    no_cache: bool = False
    no_store: bool = False


NO_DIRECTIVES = Directives()


def directives(headers: Mapping[str, str]) -> Directives:
    """Parse ``Cache-Control`` (case-insensitive tokens; unknown ones ignored, as HTTP says)."""
    value = headers.get(CACHE_CONTROL_HEADER)
    if not value:
        return NO_DIRECTIVES
    tokens = {part.strip().split("=", 1)[0].lower() for part in value.split(",")}
    return Directives(no_cache="no-cache" in tokens, no_store="no-store" in tokens)


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
