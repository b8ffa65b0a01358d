"""Kubernetes EndpointSlices (``discovery.k8s.io/v1``, as plain JSON dicts) -> discovered endpoints.

Pure: no client, no network. The watch (``kubernetes.py``) keeps the slices of
one Service by name and calls ``endpoints_from_slices`` after every event.

Readiness follows the EndpointSlice conditions (a missing ``ready`` or
``serving`` means true, a missing ``terminating`` false, as the API documents):

* ``ready``                      -> READY
* ``terminating`` and ``serving`` -> DRAINING (in-flight work finishes, nothing new)
* anything else                  -> NOT_READY (listed, not routable)

An address listed in several slices (an endpoint moving between slices
during a resync) counts once, with its best readiness. Only IP literals are
taken (as the admin API): an FQDN-type slice's hostnames or garbage are
skipped and reported, and the slice's other addresses still count.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .model import DiscoveredEndpoint, Readiness

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_RANK = {Readiness.READY: 2, Readiness.DRAINING: 1, Readiness.NOT_READY: 0}


class SliceError(ValueError):
    """An object that is not a usable EndpointSlice (missing name, bad port)."""


def readiness(conditions: Mapping[str, Any] | None) -> Readiness:
    conditions = conditions or {}
    ready = conditions.get("ready")
    serving = conditions.get("serving")
    terminating = bool(conditions.get("terminating"))
    ready = True if ready is None else bool(ready)
    serving = ready if serving is None else bool(serving)
    if terminating:
        return Readiness.DRAINING if serving else Readiness.NOT_READY
    return Readiness.READY if ready else Readiness.NOT_READY


def slice_port(endpoint_slice: Mapping[str, Any], port: str | None) -> int | None:
    """The slice's port number for ``port`` (a name or a number; None: its only/first port).

    None when the slice has no such port (an empty slice lists no ports at all).
    """
    ports = endpoint_slice.get("ports") or []
    for entry in ports:
        number = entry.get("port")
        if not isinstance(number, int) or not 0 < number < 65536:
            continue
        if port is None or entry.get("name") == port or (port.isdigit() and int(port) == number):
            return number
    return None


def slice_name(endpoint_slice: Mapping[str, Any]) -> str:
    name = (endpoint_slice.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise SliceError("EndpointSlice without metadata.name")
    return name


def read_slices(slices: Iterable[Mapping[str, Any]],
                port: str | None = None) -> tuple[tuple[DiscoveredEndpoint, ...], frozenset[str]]:
    """Every address of every slice, at the slice's ``port`` (deduplicated, sorted by id), and the
    addresses refused because they are not IP literals (an FQDN slice, garbage): skipped, the rest stand."""
    best: dict[str, DiscoveredEndpoint] = {}
    refused: set[str] = set()
    for endpoint_slice in slices:
        number = slice_port(endpoint_slice, port)
        if number is None:
            continue
        for entry in endpoint_slice.get("endpoints") or []:
            state = readiness(entry.get("conditions"))
            for address in entry.get("addresses") or []:
                try:
                    found = DiscoveredEndpoint(str(address), number, state)
                except ValueError:
                    refused.add(str(address)[:256])  # logged by the caller; bounded in case it is huge
                    continue
                known = best.get(found.id)
                if known is None or _RANK[state] > _RANK[known.readiness]:
                    best[found.id] = found
    return tuple(sorted(best.values(), key=lambda e: e.id)), frozenset(refused)


def endpoints_from_slices(slices: Iterable[Mapping[str, Any]], port: str | None = None) -> tuple[DiscoveredEndpoint, ...]:
    """The endpoints of ``read_slices``, without the refused addresses."""
    return read_slices(slices, port)[0]


def apply_event(slices: Mapping[str, Mapping[str, Any]], kind: str, obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Slices by name after one watch event (ADDED, MODIFIED or DELETED); other kinds change nothing."""
    updated = dict(slices)
    if kind in ("ADDED", "MODIFIED"):
        updated[slice_name(obj)] = obj
    elif kind == "DELETED":
        updated.pop(slice_name(obj), None)
    return updated


def label_selector(service: str) -> str:
    return f"{SERVICE_NAME_LABEL}={service}"
