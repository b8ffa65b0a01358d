"""The ClusterLoadAssignment (EDS): every endpoint with its health and weight, for two node groups.

No I/O and no clocks: the xDS server versions each resource by a hash of its
deterministic bytes, so the same state must always give the same bytes, and a
change that only touches weights or telemetry must only change the
ClusterLoadAssignment (Envoy then re-sends nothing else and keeps its
connections and listeners as they are).

Two variants of the ClusterLoadAssignment, for two node groups:

* Envoys (the default snapshot) get the lean one: address, ``health_status``
  and ``load_balancing_weight`` per endpoint, no metadata. Envoy reads
  nothing else, so telemetry changes never re-push EDS to Envoys.
* ext_proc (node cluster ``DataPlaneSettings.ext_proc_node_cluster``) gets
  the rich one; what it reads from EDS (it subscribes to EDS only):

  * ``LbEndpoint.metadata.filter_metadata["inferlb"]``: ``id``, ``weight``
    (effective), ``computed_weight``, ``pinned_weight`` (or null),
    ``draining``, ``health`` (the ``Health`` value string), what the worker
    serves (``models``, ``model_aliases``: lists of strings, sorted; ``pool``:
    a string; ``inferlb_runtime.model_routing``) and, when the
    endpoint has been scraped, every ``Telemetry`` field except
    ``observed_at`` under its own name (flat, next to the keys above),
    rounded to ``TELEMETRY_SIGNIFICANT_DIGITS`` significant digits.
  * ``LocalityLbEndpoints.metadata.filter_metadata["inferlb"]["pick_policy"]``:
    ``{"name": ..., "params": {...}}``; and ``["ext_proc_replicas"]``: the
    sorted node ids of the connected ext_proc replicas (absent when none), so
    each can find its index and partition a large fleet with the others; and
    ``["rollouts"]``: the admin API's rollouts, ``encode_rollouts(state.rollouts)``
    (``{}`` when there are none).

The ClusterLoadAssignment is assembled from pre-encoded pieces, not built as
messages: with 10,000 endpoints, building an LbEndpoint and its metadata
Struct in Python per endpoint per publish took most of a second. Every piece
is the canonical (deterministic) protobuf encoding of its part, produced by
protobuf itself where the input space is small (addresses, health, weights:
cached), or by ``struct_wire`` for Struct metadata; tests parse the result
and check that re-serialising it gives the very same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from google.protobuf.message import Message

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

from inferlb_runtime.model_routing import ALIASES_KEY, MODELS_KEY, POOL_KEY, ROLLOUTS_KEY, encode_rollouts

from ..model import MAX_WEIGHT, Endpoint, FleetState, Health, Telemetry
from .messages import socket_address, u32
from inferlb_runtime.protowire import len_field, varint

from .struct_wire import (
    CACHE_SIZE,
    FIXED64,
    encode_struct,
    map_key,
    number_entry_prefix,
    struct_entry,
)

METADATA_NAMESPACE = "inferlb"
# One locality, one priority: nothing to spill over to. 100 makes Envoy's
# availability arithmetic the plain healthy fraction (the default 140 would
# count 1 healthy host of 2 as 70% available and mask the loss).
OVERPROVISIONING_FACTOR = 100
# Figures that are metadata for ext_proc, not telemetry: never sent.
_TELEMETRY_SKIP = frozenset({"observed_at"})
# Telemetry in ext_proc's EDS metadata is rounded to this many significant digits,
# so that scrape noise does not make a new EDS version on every scrape.
TELEMETRY_SIGNIFICANT_DIGITS = 3

_EDS_HEALTH: Mapping[Health, int] = MappingProxyType({
    Health.HEALTHY: health_check_pb2.HEALTHY,
    Health.UNHEALTHY: health_check_pb2.UNHEALTHY,
    Health.UNKNOWN: health_check_pb2.UNKNOWN,
})


def _encode_metadata(struct_bytes: bytes) -> bytes:
    """The bytes of a ``core.v3.Metadata`` with a Struct under ``filter_metadata["inferlb"]``."""
    return len_field(b"\x0a", map_key(METADATA_NAMESPACE) + len_field(b"\x12", struct_bytes))


def _serialized(message: Message) -> bytes:
    return message.SerializeToString(deterministic=True)


# LbEndpoint: endpoint = 1, health_status = 2, metadata = 3, load_balancing_weight = 4;
# canonical encoding is in field-number order, so its bytes are the concatenation of
# each field encoded on its own.

@functools.lru_cache(maxsize=CACHE_SIZE)
def _lb_address(address: str, port: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=socket_address(address, port))))


@functools.lru_cache(maxsize=16)
def _lb_health(status: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(health_status=status))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=2 * MAX_WEIGHT)
def _lb_weight(weight: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(load_balancing_weight=u32(weight)))


_LB_METADATA = b"\x1a"  # LbEndpoint.metadata = 3
_LB_ENDPOINTS = b"\x12"  # LocalityLbEndpoints.lb_endpoints = 2
_LOCALITY_METADATA = b"\x4a"  # LocalityLbEndpoints.metadata = 9
_CLA_ENDPOINTS = b"\x12"  # ClusterLoadAssignment.endpoints = 2


@functools.lru_cache(maxsize=CACHE_SIZE)
def _lean_entry(address: str, port: int, health: int, weight: int) -> bytes:
    """One ``lb_endpoints`` entry of the lean (Envoy) variant: address, health, weight."""
    return len_field(_LB_ENDPOINTS, _lb_address(address, port) + _lb_health(health) + _lb_weight(weight))


_TELEMETRY_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Telemetry) if f.name not in _TELEMETRY_SKIP)
_TELEMETRY_VALUES = operator.attrgetter(*_TELEMETRY_NAMES)
_QUANTISE_FORMAT = " ".join([f"%.{TELEMETRY_SIGNIFICANT_DIGITS}g"] * len(_TELEMETRY_NAMES))
# The rich metadata Struct is encoded in two independently cached parts, so that a
# weight change does not re-encode telemetry and a scrape does not re-encode the
# rest: the entries of the base keys, and the entries of the telemetry keys in
# runs. Interleaved by _PLAN, they are the Struct's entries sorted by key (the
# canonical order), and every key here is a prefix of no other.
_BASE_KEYS = ("id", "weight", "computed_weight", "pinned_weight", "draining", "health", MODELS_KEY, ALIASES_KEY,
              POOL_KEY)
_LIST_KEYS = frozenset({MODELS_KEY, ALIASES_KEY})  # tuples in the values (hashable, cached), lists in JSON
_BASE_ORDER = tuple(sorted(range(len(_BASE_KEYS)), key=_BASE_KEYS.__getitem__))


def _interleave_plan() -> tuple[tuple[tuple[bool, int], ...], tuple[tuple[int, ...], ...]]:
    plan: list[tuple[bool, int]] = []  # (is a base entry, its position among base entries | run index)
    runs: list[list[int]] = []  # telemetry runs: indices into _TELEMETRY_NAMES
    for key in sorted(_BASE_KEYS + _TELEMETRY_NAMES):
        if key in _BASE_KEYS:
            plan.append((True, _BASE_ORDER.index(_BASE_KEYS.index(key))))
        elif plan and not plan[-1][0]:
            runs[-1].append(_TELEMETRY_NAMES.index(key))
        else:
            plan.append((False, len(runs)))
            runs.append([_TELEMETRY_NAMES.index(key)])
    return tuple(plan), tuple(tuple(run) for run in runs)


_PLAN, _TELEMETRY_RUNS = _interleave_plan()
_TELEMETRY_RUN_PREFIXES = tuple(tuple(number_entry_prefix(_TELEMETRY_NAMES[i]) for i in run)
                                for run in _TELEMETRY_RUNS)


def quantise(value: float, digits: int = TELEMETRY_SIGNIFICANT_DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits (so that noise makes no new EDS version)."""
    return float(f"%.{digits}g" % value)


def _quantised_text(telemetry: Telemetry | None) -> str | None:
    return None if telemetry is None else _QUANTISE_FORMAT % _TELEMETRY_VALUES(telemetry)


def _base_values(endpoint: Endpoint) -> tuple[object, ...]:
    return (endpoint.id, endpoint.effective_weight, endpoint.computed_weight, endpoint.pinned_weight,
            endpoint.draining, endpoint.health.value, endpoint.models, endpoint.model_aliases, endpoint.pool)


def _base_entries(values: tuple[object, ...]) -> tuple[bytes, ...]:
    """The base keys' Struct entries, sorted by key."""
    return tuple(struct_entry(_BASE_KEYS[i], values[i]) for i in _BASE_ORDER)


def _telemetry_runs(text: str) -> tuple[bytes, ...]:
    """The telemetry keys' Struct entries (``text``: the quantised figures), run by run."""
    values = [float(v) for v in text.split()]
    return tuple(b"".join(map(operator.add, prefixes, [FIXED64(values[i]) for i in run]))
                 for run, prefixes in zip(_TELEMETRY_RUNS, _TELEMETRY_RUN_PREFIXES))


class _Parts:
    """The two parts of the rich metadata kept from one build to the next (``EndpointMemo``): the base
    entries, which a scrape leaves as they were, and the telemetry runs, which a weight change leaves.

    Generational, not an LRU: a build keeps only what it used, so memory follows the fleet's size. Telemetry
    and computed weights take new values at every scrape and rarely repeat one, so a cache over past values
    (an ``lru_cache`` of 32,768 entries each, before) kept about 3 KB per endpoint per scrape until full:
    the soak saw the control plane's RSS grow 14 MiB per 10 minutes with 4 workers.
    """

    __slots__ = ("base", "telemetry", "_base_used", "_telemetry_used")

    def __init__(self) -> None:
        self.base: dict[tuple[object, ...], tuple[bytes, ...]] = {}
        self.telemetry: dict[str, tuple[bytes, ...]] = {}
        self._base_used: dict[tuple[object, ...], tuple[bytes, ...]] = {}
        self._telemetry_used: dict[str, tuple[bytes, ...]] = {}

    def base_entries(self, values: tuple[object, ...]) -> tuple[bytes, ...]:
        found = self._base_used.get(values) or self.base.get(values) or _base_entries(values)
        self._base_used[values] = found
        return found

    def telemetry_runs(self, text: str) -> tuple[bytes, ...]:
        found = self._telemetry_used.get(text) or self.telemetry.get(text) or _telemetry_runs(text)
        self._telemetry_used[text] = found
        return found

    def keep(self, values: tuple[object, ...], text: str | None) -> None:
        """An unchanged endpoint's parts stay reusable (two dict moves, no encoding)."""
        found = self.base.get(values)
        if found is not None:
            self._base_used[values] = found
        if text is not None and (runs := self.telemetry.get(text)) is not None:
            self._telemetry_used[text] = runs

    def next_generation(self) -> None:
        """End a build: what it used is what the next one may reuse."""
        self.base, self._base_used = self._base_used, {}
        self.telemetry, self._telemetry_used = self._telemetry_used, {}


def _rich_metadata(base: tuple[bytes, ...], telemetry: tuple[bytes, ...] | None) -> bytes:
    """The encoded ``LbEndpoint.metadata`` field of the rich (ext_proc) variant."""
    if telemetry is None:
        body = b"".join(base)
    else:
        body = b"".join([base[i] if is_base else telemetry[i] for is_base, i in _PLAN])
    return len_field(_LB_METADATA, _encode_metadata(body))


def _endpoint_rich_metadata(values: tuple[object, ...], text: str | None, parts: _Parts | None) -> bytes:
    """The rich metadata of an endpoint with base ``values`` and quantised telemetry ``text``."""
    if parts is None:
        return _rich_metadata(_base_entries(values), None if text is None else _telemetry_runs(text))
    return _rich_metadata(parts.base_entries(values), None if text is None else parts.telemetry_runs(text))


def _rich_entry(address: str, port: int, health: int, weight: int, metadata: bytes) -> bytes:
    """One ``lb_endpoints`` entry of the rich (ext_proc) variant."""
    return len_field(_LB_ENDPOINTS, b"".join((_lb_address(address, port), _lb_health(health), metadata,
                                                _lb_weight(weight))))


def endpoint_metadata(endpoint: Endpoint) -> dict[str, object]:
    """What ext_proc knows about one endpoint (see the module docstring); telemetry is quantised."""
    meta = {key: list(value) if key in _LIST_KEYS else value  # type: ignore[call-overload]
            for key, value in zip(_BASE_KEYS, _base_values(endpoint))}
    text = _quantised_text(endpoint.telemetry)
    if text is not None:
        meta.update(zip(_TELEMETRY_NAMES, map(float, text.split())))
    return meta


def eds_health(endpoint: Endpoint) -> int:
    """DRAINING beats everything: Envoy then excludes the host from new picks and lets it finish."""
    if endpoint.draining:
        return health_check_pb2.DRAINING
    return _EDS_HEALTH[endpoint.health]


def _lb_endpoint_entry(endpoint: Endpoint, rich: bool) -> bytes:
    return _encoded_entry(endpoint, rich, None)[0]


def _encoded_entry(endpoint: Endpoint, rich: bool, parts: _Parts | None
                   ) -> tuple[bytes, tuple[object, ...] | None, str | None]:
    """An ``lb_endpoints`` entry, with the keys of its rich metadata's parts (None: lean)."""
    health, weight = eds_health(endpoint), endpoint.effective_weight
    if not rich:
        return _lean_entry(endpoint.address, endpoint.port, health, weight), None, None
    values, text = _base_values(endpoint), _quantised_text(endpoint.telemetry)
    return _rich_entry(endpoint.address, endpoint.port, health, weight,
                       _endpoint_rich_metadata(values, text, parts)), values, text


def _locality_metadata(state: FleetState, replicas: Sequence[str] = ()) -> bytes:
    policy: dict[str, object] = {"pick_policy": {"name": state.pick_policy.name,
                                                 "params": dict(state.pick_policy.params)},
                                 ROLLOUTS_KEY: encode_rollouts(state.rollouts)}
    if replicas:
        policy["ext_proc_replicas"] = list(replicas)
    return len_field(_LOCALITY_METADATA, _encode_metadata(encode_struct(policy)))


@functools.lru_cache(maxsize=16)
def _cla_head(cluster_name: str) -> bytes:
    return _serialized(endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name))


_CLA_POLICY = _serialized(endpoint_pb2.ClusterLoadAssignment(
    policy=endpoint_pb2.ClusterLoadAssignment.Policy(overprovisioning_factor=u32(OVERPROVISIONING_FACTOR))))


class EndpointMemo:
    """The last build's per-endpoint encodings, by endpoint *object*: an optional speed-up
    that the caller owns (the controller keeps one per EDS variant) and passes in.

    ``Endpoint`` values are immutable, so an object seen in the previous build
    encodes to the same bytes: a state that shares most endpoint objects with the
    previous one (``dataclasses.replace`` of a few) costs a dict lookup per
    unchanged endpoint. The memo holds the objects, so their ids are not reused.
    It never changes the bytes; one memo must serve one variant only, and one
    build at a time.
    """

    __slots__ = ("_entries", "_parts")

    def __init__(self) -> None:
        # by id(endpoint): the endpoint, its id, its entry and its parts' keys (values, text)
        self._entries: dict[int, tuple[Endpoint, str, bytes, tuple[object, ...] | None, str | None]] = {}
        self._parts = _Parts()  # for the endpoints that changed: see _Parts


def _sorted_entries(endpoints: Sequence[Endpoint], rich: bool, memo: EndpointMemo | None) -> list[bytes]:
    previous = memo._entries if memo is not None else {}
    parts = memo._parts if memo is not None else None
    current: dict[int, tuple[Endpoint, str, bytes, tuple[object, ...] | None, str | None]] = {}
    items = []
    for endpoint in endpoints:
        key = id(endpoint)
        known = previous.get(key)
        if known is None or known[0] is not endpoint:
            known = (endpoint, endpoint.id, *_encoded_entry(endpoint, rich, parts))
        elif parts is not None and known[3] is not None:  # unchanged: its parts stay reusable next build
            parts.keep(known[3], known[4])
        current[key] = known
        items.append(known)
    if memo is not None:
        memo._entries = current
        memo._parts.next_generation()
    items.sort(key=_BY_ID)  # stable: by id, then as given
    return [item[2] for item in items]


_BY_ID = operator.itemgetter(1)


def encode_load_assignment(state: FleetState, *, ext_proc: bool = False, memo: EndpointMemo | None = None,
                           replicas: Sequence[str] = ()) -> bytes:
    """The deterministic bytes of :func:`build_load_assignment` (fast: no message is built).

    ``ext_proc=False``: the lean variant Envoy gets (address, health, weight);
    ``ext_proc=True``: the rich variant ext_proc gets (plus the metadata of the module docstring).
    ``memo``: see :class:`EndpointMemo` (the bytes are the same with or without it).
    ``replicas``: the connected ext_proc node ids (rich variant only; see the module docstring).
    """
    entries = _sorted_entries(state.endpoints, ext_proc, memo)
    if ext_proc:
        entries.append(_locality_metadata(state, sorted(replicas)))
    locality = b"".join(entries)
    return b"".join((_cla_head(state.settings.workers_cluster), _CLA_ENDPOINTS, varint(len(locality)), locality,
                     _CLA_POLICY))


def build_lb_endpoint(endpoint: Endpoint, *, ext_proc: bool = False) -> endpoint_components_pb2.LbEndpoint:
    """One endpoint as it appears in :func:`build_load_assignment`."""
    entry = _lb_endpoint_entry(endpoint, ext_proc)  # an lb_endpoints entry of a LocalityLbEndpoints
    (lb_endpoint,) = endpoint_components_pb2.LocalityLbEndpoints.FromString(entry).lb_endpoints
    return lb_endpoint


def build_load_assignment(state: FleetState, *, ext_proc: bool = False,
                          replicas: Sequence[str] = ()) -> endpoint_pb2.ClusterLoadAssignment:
    """Every endpoint with its weight and health, in one locality, sorted by id.

    The ext_proc variant adds each endpoint's metadata, and the pick policy and rollouts on the locality.
    """
    return endpoint_pb2.ClusterLoadAssignment.FromString(encode_load_assignment(state, ext_proc=ext_proc,
                                                                                replicas=replicas))


def weights_of(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, int]:
    """``host:port`` -> load_balancing_weight, over every locality of a ClusterLoadAssignment."""
    weights: dict[str, int] = {}
    for locality in cla.endpoints:
        for lb_endpoint in locality.lb_endpoints:
            socket = lb_endpoint.endpoint.address.socket_address
            weights[f"{socket.address}:{socket.port_value}"] = lb_endpoint.load_balancing_weight.value
    return weights
