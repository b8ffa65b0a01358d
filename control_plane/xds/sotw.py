"""State of the World (StreamAggregatedResources): each response carries the whole requested set.

Why its own module: what a SotW request means and what a SotW response must carry differ from
Delta at every step, while the ACK/NACK bookkeeping and ordering are shared (``protocol``).

* A request whose non-empty ``response_nonce`` is not the latest nonce sent
  for its type is stale and ignored entirely (no ACK/NACK, no response).
* A request with no nonce is a fresh subscription: it always gets a response.
* Wildcard: CDS/LDS requests that never named a resource (or name "*").
  CDS/LDS responses carry the whole set, so a removal there is first a
  response with the union of what the client has and the new set (a
  transitional version ``<version>+<hash>``), then the final set. EDS/RDS
  responses carry only the requested names that are new or changed for this
  client (the spec allows it for these types), and have no removals: their
  parents stop referring to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

from ..type_urls import ENDPOINT
from .clients import Mode
from .protocol import FULL_STATE_TYPES, Plan, Sent, StreamProtocol, TypeState
from .snapshot import Snapshot, VersionedResource, digest_names


@dataclass(slots=True)
class _SotwState(TypeState):
    explicit: bool = False  # names were given once: an empty list no longer means wildcard
    acked: dict[str, VersionedResource] = field(default_factory=dict)
    force: set[str] = field(default_factory=set)  # names to send even if the client has them


class SotwProtocol(StreamProtocol[_SotwState]):
    """One SotW stream: subscriptions replace each other, responses carry whole sets (CDS, LDS)."""

    mode: Mode = "sotw"

    def _new_state(self) -> _SotwState:
        return _SotwState()

    def handle(self, request: Message) -> None:
        assert isinstance(request, discovery_pb2.DiscoveryRequest)
        type_url = request.type_url
        if not self._known_type(type_url):
            return
        state, _ = self._state(type_url)
        nonce = request.response_nonce
        if self._stale(state, type_url, nonce):
            return  # the spec: never answer a stale request
        if not nonce:
            # A fresh subscription: the client holds nothing of this type from this stream.
            state.acked.clear()
            state.inflight = None
            state.must_respond = True
        elif state.inflight is not None:
            self._answer(type_url, state, request)
        self._subscribe(type_url, state, list(request.resource_names))
        self.record.subscribed(type_url, state.wildcard, state.names)

    def _subscribe(self, type_url: str, state: _SotwState, names: list[str]) -> None:
        if type_url in FULL_STATE_TYPES:
            if not names and not state.explicit:
                wildcard, wanted = True, set()
            else:
                state.explicit = True
                wildcard, wanted = "*" in names, set(names) - {"*"}
        else:
            wildcard, wanted = False, set(names)
        if wildcard and not state.wildcard:
            state.must_respond = True
        # Newly requested names must be sent even if the client saw them before.
        state.force |= wanted - state.names
        state.wildcard, state.names = wildcard, wanted
        if not wildcard:  # the client forgets what it no longer asks for
            state.acked = {n: r for n, r in state.acked.items() if n in wanted}

    def _apply_ack(self, type_url: str, state: _SotwState, sent: Sent) -> None:
        acked = {n: r for n, r in sent.resources.items() if state.wildcard or n in state.names}
        if type_url in FULL_STATE_TYPES:
            state.acked = acked  # the response was the whole set
        else:
            state.acked.update(acked)

    def _acked_version(self, state: _SotwState, name: str) -> str | None:
        acked = state.acked.get(name)
        return acked.version if acked is not None else None

    def _rewarm(self, eds_names: list[str]) -> None:
        eds = self._types.get(ENDPOINT)
        if eds is not None:
            eds.force.update(eds_names)

    def _emitted(self, state: _SotwState) -> None:
        state.force.clear()  # forced names that exist were just sent; absent ones are not acked anyway

    @staticmethod
    def _desired(state: _SotwState, current: Mapping[str, VersionedResource]) -> dict[str, VersionedResource]:
        if state.wildcard:
            return dict(current)
        return {n: current[n] for n in sorted(state.names) if n in current}

    def _update_plan(self, type_url: str, state: _SotwState, snapshot: Snapshot) -> Plan | None:
        current = snapshot.resources(type_url)
        desired = self._desired(state, current)
        acked = state.acked
        changed = {n for n, r in desired.items() if (a := acked.get(n)) is None or a.version != r.version}
        forced = state.force & desired.keys()
        version = snapshot.version(type_url)
        if type_url in FULL_STATE_TYPES:
            if not changed and not forced and not state.must_respond:
                return None
            # Make before break: keep what the client has until every update is settled.
            retained = {n: r for n, r in acked.items() if n not in current}
            if retained:
                version = f"{version}+{digest_names(retained)}"
            resources = {**desired, **retained}
            if not state.must_respond and state.rejected(version, resources):
                return None
            return Plan(version, resources)
        names = changed | forced
        if state.nacked is not None and state.nacked.version == version:
            names -= state.nacked.resources.keys()
        if not names and not state.must_respond:
            return None
        return Plan(version, {n: r for n, r in desired.items() if n in names})

    def _removal_plan(self, type_url: str, state: _SotwState, snapshot: Snapshot) -> Plan | None:
        if type_url not in FULL_STATE_TYPES:
            return None  # EDS/RDS: SotW has no removal; parents stop referring to them
        current = snapshot.resources(type_url)
        removed = frozenset(n for n in state.acked if n not in current)
        if not removed:
            return None
        desired = self._desired(state, current)
        version = snapshot.version(type_url)
        if state.rejected(version, desired):
            return None
        return Plan(version, desired, removed)

    def _response(self, type_url: str, nonce: str, plan: Plan) -> bytes:
        return encode_sotw_response(type_url, plan.version, nonce, plan.resources.values())


def encode_sotw_response(type_url: str, version: str, nonce: str, resources: Iterable[VersionedResource]) -> bytes:
    """The bytes of ``DiscoveryResponse(version_info, resources, type_url, nonce)`` from the
    resources' pre-encoded entries (fields in number order: what deterministic protobuf gives)."""
    return b"".join((
        discovery_pb2.DiscoveryResponse(version_info=version).SerializeToString(),  # 1
        *(_sotw_entry(r) for r in resources),  # 2
        discovery_pb2.DiscoveryResponse(type_url=type_url, nonce=nonce).SerializeToString(),  # 4, 5
    ))


def _sotw_entry(resource: VersionedResource) -> bytes:
    if resource.sotw_entry:
        return resource.sotw_entry
    return discovery_pb2.DiscoveryResponse(resources=[resource.any]).SerializeToString()
