"""What both ADS variants share, per stream: the ACK/NACK bookkeeping and when a type may be sent.

Why one state machine for both: the rules below are the protocol, whichever variant carries it;
``sotw`` and ``delta`` say only how a request subscribes and what a response must carry.

* One unacknowledged response per type per stream. While one is out, changes
  for that type wait; on the ACK the stream sends the *latest* state, never
  the intermediate ones.
* A NACK is recorded (status, counters, a warning log) and the rejected
  response is never sent again as is: the stream sends that type again only
  when the snapshot's version of it changes, or the client subscribes to
  something the rejected response did not carry. This is the go-control-plane
  failure ("resend the NACKed config forever") designed out.
* Order CDS -> EDS -> LDS -> RDS. LDS and RDS are held until CDS and EDS are
  settled (acknowledged, or rejected, at the snapshot's current versions), as
  Consul does. EDS is deliberately NOT held behind the CDS ACK: Envoy finishes
  warming a new or changed cluster only when it receives a
  ClusterLoadAssignment, and it may not ACK CDS before then (see the spec's
  "Resource warming" section and Consul's hashicorp/consul#15083), so holding
  EDS could stall warming until ``initial_fetch_timeout``. EDS still goes out
  after CDS on the same stream, so Envoy always sees the cluster first. For
  the same reason, after a cluster changes, its ClusterLoadAssignment is resent
  even if the endpoints did not change ("warming completes only when a new
  ClusterLoadAssignment is supplied").
* Removals last (make before break): additions and updates for every type go
  out, in order, and are settled first; only then the responses that drop
  resources, in reverse order (RDS, LDS, EDS, CDS: stop referring before
  deleting).
* A fresh request for a type (the first on a stream, or a SotW request with
  no nonce) always gets a response, even an empty one, so Envoy's
  initialisation never waits for ``initial_fetch_timeout``; unless the
  group's snapshot does not carry the type at all (ext_proc's API key table,
  ``type_urls.EXTENSION_TYPES``, asked for on an Envoy's stream): that is
  never answered, and never holds up the other types.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Generic, Iterable, Mapping, TypeVar

from google.protobuf.message import Message

from ..type_urls import CLUSTER, ENDPOINT, LISTENER, ROUTE, SERVED_TYPES, SHORT_NAMES
from .cache import SnapshotCache
from .clients import Mode, StreamRecord, XdsMetrics
from .snapshot import Snapshot, VersionedResource

LOG = logging.getLogger(__name__)

FULL_STATE_TYPES = frozenset({CLUSTER, LISTENER})  # SotW responses carry the whole set; wildcard allowed
HELD_TYPES = frozenset({LISTENER, ROUTE})  # held until every GATING_TYPES type is settled
GATING_TYPES = (CLUSTER, ENDPOINT)


@dataclass(frozen=True, slots=True)
class Sent:
    """One response as sent: what the client has once it ACKs it."""

    nonce: str
    version: str
    resources: Mapping[str, VersionedResource]
    removed: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Plan:
    version: str
    resources: Mapping[str, VersionedResource]
    removed: frozenset[str] = frozenset()


@dataclass(slots=True)
class TypeState:
    """Per stream, per type: the subscription and where the ACK/NACK exchange stands."""

    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    nonce: str = ""  # the latest nonce sent for this type
    inflight: Sent | None = None  # the one unacknowledged response
    nacked: Sent | None = None  # the last rejected response: never resent as is
    must_respond: bool = True  # a fresh request: answer even if nothing is new

    def rejected(self, version: str, names: Iterable[str], removed: Iterable[str] = ()) -> bool:
        """Would this response repeat (part of) one the client already NACKed?"""
        nacked = self.nacked
        return (nacked is not None and nacked.version == version
                and set(names) <= nacked.resources.keys() and set(removed) <= nacked.removed)


S = TypeVar("S", bound=TypeState)


def log_extra(record: StreamRecord, event: str, **fields: object) -> dict[str, object]:
    return {"xds_event": event, "stream_id": record.stream_id, "node_id": record.node_id,
            "group": record.group, "mode": record.mode, **fields}


class StreamProtocol(ABC, Generic[S]):
    """The per-stream protocol state machine; pure bookkeeping, no I/O, no awaits.

    ``handle`` digests one request; ``plan`` returns the responses to send now
    and records them as sent (status updates happen here, synchronously, so a
    reader of ``SnapshotCache.clients()`` sees decisions as soon as they are made).
    """

    mode: Mode

    def __init__(self, record: StreamRecord, cache: SnapshotCache, metrics: XdsMetrics) -> None:
        self.record = record
        self._cache = cache
        self._metrics = metrics
        self._serial = itertools.count(1)
        self._types: dict[str, S] = {}

    # -- requests ------------------------------------------------------------------

    def _state(self, type_url: str) -> tuple[S, bool]:
        state = self._types.get(type_url)
        if state is None:
            state = self._types[type_url] = self._new_state()
            return state, True
        return state, False

    def _known_type(self, type_url: str) -> bool:
        if type_url in SERVED_TYPES:
            return True
        LOG.debug("ignoring request for unserved type %s", type_url,
                  extra=log_extra(self.record, "unknown_type", type_url=type_url))
        return False

    def _stale(self, state: S, type_url: str, nonce: str) -> bool:
        if not nonce or nonce == state.nonce:
            return False
        LOG.debug("stale nonce %s for %s (latest %s)", nonce, SHORT_NAMES[type_url], state.nonce,
                  extra=log_extra(self.record, "stale", type_url=type_url, nonce=nonce))
        return True

    def _answer(self, type_url: str, state: S, request: Message) -> None:
        """The client ACKed or NACKed the in-flight response."""
        sent = state.inflight
        assert sent is not None
        state.inflight = None
        if request.HasField("error_detail"):  # type: ignore[attr-defined]
            error = request.error_detail.message  # type: ignore[attr-defined]
            state.nacked = sent
            self.record.nacked(type_url, sent.version, sent.nonce, error)
            self._cache.count_nack(type_url)
            self._metrics.on_nack(type_url)
            LOG.warning("%s NACKed %s version %s: %s", self.record.node_id, SHORT_NAMES[type_url],
                        sent.version, error, extra=log_extra(self.record, "nack", type_url=type_url,
                                                              version=sent.version, nonce=sent.nonce,
                                                              error=error))
            return
        self._apply_ack(type_url, state, sent)
        if state.nacked is not None and state.nacked.version != sent.version:
            state.nacked = None
        self.record.acked(type_url, sent.version)
        self._cache.count_ack(type_url)
        self._metrics.on_ack(type_url)
        LOG.debug("%s ACKed %s version %s", self.record.node_id, SHORT_NAMES[type_url], sent.version,
                  extra=log_extra(self.record, "ack", type_url=type_url, version=sent.version,
                                   nonce=sent.nonce))

    # -- responses -----------------------------------------------------------------

    def plan(self, snapshot: Snapshot) -> list[tuple[str, bytes]]:
        """The responses due now, as (type URL, serialised response): updates in push order,
        else removals in reverse order."""
        out: list[tuple[str, bytes]] = []
        for type_url in SERVED_TYPES:
            state = self._types.get(type_url)
            if state is None or state.inflight is not None or type_url not in snapshot.by_type:
                continue
            if type_url in HELD_TYPES and not all(self._settled(t, snapshot) for t in GATING_TYPES):
                continue
            plan = self._update_plan(type_url, state, snapshot)
            if plan is not None:
                out.append(self._emit(type_url, state, plan, snapshot))
        if out or not all(self._settled(t, snapshot) for t in self._types):
            return out
        for type_url in reversed(SERVED_TYPES):
            state = self._types.get(type_url)
            if state is None or type_url not in snapshot.by_type:
                continue
            plan = self._removal_plan(type_url, state, snapshot)
            if plan is not None:
                out.append(self._emit(type_url, state, plan, snapshot))
        return out

    def _settled(self, type_url: str, snapshot: Snapshot) -> bool:
        """Nothing in flight and nothing new to send (a NACK at this version counts as settled; so does a type
        the group's snapshot does not carry: ext_proc's key table, asked for on an Envoy's stream)."""
        state = self._types.get(type_url)
        return state is None or (state.inflight is None and (
            type_url not in snapshot.by_type or self._update_plan(type_url, state, snapshot) is None))

    def _emit(self, type_url: str, state: S, plan: Plan, snapshot: Snapshot) -> tuple[str, bytes]:
        nonce = f"{self.record.stream_id}-{next(self._serial)}"
        if type_url == CLUSTER:
            changed = [n for n, r in plan.resources.items() if self._acked_version(state, n) != r.version]
            self._rewarm([snapshot.eds_names[n] for n in changed if n in snapshot.eds_names])
        response = self._response(type_url, nonce, plan)
        state.inflight = Sent(nonce, plan.version, plan.resources, plan.removed)
        state.nonce = nonce
        state.must_respond = False
        self._emitted(state)
        self.record.sent(type_url, plan.version, nonce)
        self._cache.count_push(type_url)
        LOG.debug("push %s version %s: %d resources, %d removed", SHORT_NAMES[type_url], plan.version,
                  len(plan.resources), len(plan.removed),
                  extra=log_extra(self.record, "push", type_url=type_url, version=plan.version, nonce=nonce))
        return type_url, response

    # -- mode specific ---------------------------------------------------------------

    def _emitted(self, state: S) -> None:
        """Hook: a response for this type was just planned."""

    @abstractmethod
    def _new_state(self) -> S: ...

    @abstractmethod
    def handle(self, request: Message) -> None: ...

    @abstractmethod
    def _apply_ack(self, type_url: str, state: S, sent: Sent) -> None: ...

    @abstractmethod
    def _acked_version(self, state: S, name: str) -> str | None: ...

    @abstractmethod
    def _rewarm(self, eds_names: list[str]) -> None:
        """Make the stream resend these ClusterLoadAssignments (their cluster changed)."""

    @abstractmethod
    def _update_plan(self, type_url: str, state: S, snapshot: Snapshot) -> Plan | None:
        """Additions and changes due for one type (pure: no state changes)."""

    @abstractmethod
    def _removal_plan(self, type_url: str, state: S, snapshot: Snapshot) -> Plan | None:
        """The response that drops removed resources of one type, if any (pure)."""

    @abstractmethod
    def _response(self, type_url: str, nonce: str, plan: Plan) -> bytes:
        """The serialised response (DiscoveryResponse or DeltaDiscoveryResponse)."""
