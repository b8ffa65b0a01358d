"""API keys: the format the control plane issues, the hash both sides agree on, and the table it pushes.

The control plane's admin API issues keys (``POST /v1/api-keys``), keeps only
their SHA-256 and pushes the table of live keys to ext_proc over xDS, as one
``google.protobuf.Struct`` resource named :data:`API_KEYS_RESOURCE`. ext_proc
hashes the bearer key a client sends and looks it up there, so neither the
wire nor either store ever holds a usable key. A plain hash is enough
because the keys are 256 random bits (nothing to guess, unlike a password);
a slow password hash would cost milliseconds per request.

Everything a request's treatment depends on comes from its key: its tenant
(whose counters and queue it shares with the tenant's other keys), its
priority class (the default, and the best a request may claim), its weight
in the fair shares, and its quotas. Both sides encode and decode the table
with :func:`encode_table` and :func:`decode_table`, so they cannot disagree
on a field.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from inferlb_runtime.request_class import PRIORITIES, Priority

KEY_PREFIX = "ilb-"  # recognisable in logs and by secret scanners, like OpenAI's "sk-"
KEYS_TYPE_URL = "type.googleapis.com/google.protobuf.Struct"
API_KEYS_RESOURCE = "inferlb-api-keys"
ANONYMOUS_TENANT = "anonymous"  # requests without a key, when keys are not required
# A tenant name is a metric label value and a Redis key part: keep it short and plain.
TENANT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)
_HASH_HEX = re.compile(r"^[0-9a-f]{64}$")


def new_key() -> str:
    """A fresh key: the prefix and 256 random bits, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored and pushed form of a key: SHA-256, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    """Constant-time comparison of two hashes (for lookups that compare rather than index)."""
    return hmac.compare_digest(a, b)


def bearer_key(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` header, or None (absent, or another scheme)."""
    if not authorization:
        return None
    match = _BEARER.match(authorization)
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits, as its key carries them; None: unlimited."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_tokens_in_flight: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.tokens_per_minute is None and self.requests_per_minute is None \
            and self.max_tokens_in_flight is None


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One live key as ext_proc sees it: never the key itself, only its hash."""

    hash: str
    id: str
    tenant: str
    priority: Priority = Priority.STANDARD
    weight: float = 1.0
    quota: Quota = Quota()


class InvalidKeyTable(ValueError):
    """A pushed table ext_proc cannot use (it NACKs with this message and keeps the last one)."""


_QUOTA_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_tokens_in_flight")


def encode_table(entries: Iterable[KeyEntry]) -> dict[str, Any]:
    """The resource's content, as plain JSON-able data (the control plane packs it into a Struct)."""
    keys = []
    for e in sorted(entries, key=lambda e: e.id):
        item: dict[str, Any] = {"hash": e.hash, "id": e.id, "tenant": e.tenant,
                                "priority": e.priority.name.lower(), "weight": e.weight}
        for name in _QUOTA_FIELDS:
            value = getattr(e.quota, name)
            if value is not None:
                item[name] = value
        keys.append(item)
    return {"keys": keys}


def decode_table(data: Mapping[str, Any]) -> tuple[KeyEntry, ...]:
    """The entries of a pushed table (Struct numbers arrive as floats); :class:`InvalidKeyTable` if malformed."""
    keys = data.get("keys")
    if not isinstance(keys, list):
        raise InvalidKeyTable("api key table: 'keys' must be a list")
    out = []
    for i, item in enumerate(keys):
        if not isinstance(item, Mapping):
            raise InvalidKeyTable(f"api key table: keys[{i}] is not an object")
        out.append(_entry(i, item))
    return tuple(out)


def _entry(i: int, item: Mapping[str, Any]) -> KeyEntry:
    where = f"api key table: keys[{i}]"
    digest, key_id, tenant = item.get("hash"), item.get("id"), item.get("tenant")
    if not isinstance(digest, str) or not _HASH_HEX.match(digest):
        raise InvalidKeyTable(f"{where}.hash must be 64 lower-case hex digits")
    if not isinstance(key_id, str) or not key_id:
        raise InvalidKeyTable(f"{where}.id must be a non-empty string")
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise InvalidKeyTable(f"{where}.tenant {tenant!r} does not match {TENANT_PATTERN.pattern}")
    priority = PRIORITIES.get(str(item.get("priority", "standard")))
    if priority is None:
        raise InvalidKeyTable(f"{where}.priority must be one of {', '.join(PRIORITIES)}")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
        raise InvalidKeyTable(f"{where}.weight must be a number in (0, 1000]")
    limits: dict[str, int | None] = {}
    for name in _QUOTA_FIELDS:
        value = item.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
                raise InvalidKeyTable(f"{where}.{name} must be a positive integer")
            value = int(value)
        limits[name] = value
    return KeyEntry(digest, key_id, tenant, priority, float(weight), Quota(**limits))
