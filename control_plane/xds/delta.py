"""Delta (DeltaAggregatedResources): each response carries what changed, and names what was removed.

Why its own module: Delta subscriptions are increments (subscribe, unsubscribe), and the client
tells what it already has, so its bookkeeping is per resource version; the ACK/NACK bookkeeping
and ordering are shared with SotW (``protocol``).

* Subscription changes are honoured even on a stale nonce (the spec says so);
  only the ACK/NACK part of a stale request is ignored.
* A new stream starts from what the client declares in
  ``initial_resource_versions``: resources it already has are not resent.
* Wildcard: CDS/LDS requests that subscribe to nothing (or to "*"). A name
  unsubscribed while the wildcard covers it is resent or reported removed,
  so the client knows where it stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

from ..type_urls import ENDPOINT
from .clients import Mode
from .protocol import FULL_STATE_TYPES, Plan, Sent, StreamProtocol, TypeState
from .snapshot import Snapshot, VersionedResource


@dataclass(slots=True)
class _DeltaState(TypeState):
    acked: dict[str, str] = field(default_factory=dict)  # name -> version the client has
    told_absent: set[str] = field(default_factory=set)  # explicit names we said do not exist
    notify_removed: set[str] = field(default_factory=set)  # wildcard-unsubscribe answers owed


class DeltaProtocol(StreamProtocol[_DeltaState]):
    """One Delta stream: subscriptions are increments, responses carry changes and removed names."""

    mode: Mode = "delta"

    def _new_state(self) -> _DeltaState:
        return _DeltaState()

    def handle(self, request: Message) -> None:
        assert isinstance(request, discovery_pb2.DeltaDiscoveryRequest)
        type_url = request.type_url
        if not self._known_type(type_url):
            return
        state, first = self._state(type_url)
        nonce = request.response_nonce
        if nonce and not self._stale(state, type_url, nonce) and state.inflight is not None:
            self._answer(type_url, state, request)
        subscribe = list(request.resource_names_subscribe)
        unsubscribe = list(request.resource_names_unsubscribe)
        if first:
            state.wildcard = type_url in FULL_STATE_TYPES and not subscribe and not unsubscribe
            self._subscribe(type_url, state, subscribe, fresh=True)
            self._unsubscribe(type_url, state, unsubscribe)
            # What the client already has (a reconnect): do not resend it.
            state.acked = dict(request.initial_resource_versions)
        else:
            self._subscribe(type_url, state, subscribe, fresh=False)
            self._unsubscribe(type_url, state, unsubscribe)
        self.record.subscribed(type_url, state.wildcard, state.names)

    @staticmethod
    def _subscribe(type_url: str, state: _DeltaState, names: list[str], fresh: bool) -> None:
        for name in names:
            if name == "*" and type_url in FULL_STATE_TYPES:
                state.wildcard = True
                continue
            state.names.add(name)
            if not fresh:  # the spec: a (re)subscribed resource must be sent even if the client has it
                state.acked.pop(name, None)
                state.told_absent.discard(name)

    @staticmethod
    def _unsubscribe(type_url: str, state: _DeltaState, names: list[str]) -> None:
        for name in names:
            if name == "*" and type_url in FULL_STATE_TYPES:
                state.wildcard = False
                state.acked = {n: v for n, v in state.acked.items() if n in state.names}
                continue
            state.names.discard(name)
            state.told_absent.discard(name)
            state.acked.pop(name, None)
            if state.wildcard:
                # The spec's exception: the client cannot tell whether the wildcard still
                # covers it, so resend it (it is dropped from acked) or say it is removed.
                state.notify_removed.add(name)

    def _apply_ack(self, type_url: str, state: _DeltaState, sent: Sent) -> None:
        for name, resource in sent.resources.items():
            if state.wildcard or name in state.names:
                state.acked[name] = resource.version
        for name in sent.removed:
            state.acked.pop(name, None)
            state.told_absent.add(name)
        state.told_absent.difference_update(sent.resources)
        state.notify_removed.difference_update(sent.removed)
        state.notify_removed.difference_update(sent.resources)

    def _acked_version(self, state: _DeltaState, name: str) -> str | None:
        return state.acked.get(name)

    def _rewarm(self, eds_names: list[str]) -> None:
        eds = self._types.get(ENDPOINT)
        if eds is not None:
            for name in eds_names:
                eds.acked.pop(name, None)

    def _update_plan(self, type_url: str, state: _DeltaState, snapshot: Snapshot) -> Plan | None:
        current = snapshot.resources(type_url)
        acked = state.acked
        candidates: Iterable[str] = current if state.wildcard else sorted(state.names)
        updates = {n: r for n in candidates if (r := current.get(n)) is not None and acked.get(n) != r.version}
        version = snapshot.version(type_url)
        if state.nacked is not None and state.nacked.version == version:
            updates = {n: r for n, r in updates.items() if n not in state.nacked.resources}
        if not updates and not state.must_respond:
            return None
        return Plan(version, updates)

    def _removal_plan(self, type_url: str, state: _DeltaState, snapshot: Snapshot) -> Plan | None:
        current = snapshot.resources(type_url)
        removed = {n for n in state.acked if n not in current}
        removed.update(n for n in state.names if n not in current and n not in state.told_absent)
        removed.update(n for n in state.notify_removed if n not in current)
        version = snapshot.version(type_url)
        if state.nacked is not None and state.nacked.version == version:
            removed -= state.nacked.removed
        if not removed:
            return None
        return Plan(version, {}, frozenset(removed))

    def _response(self, type_url: str, nonce: str, plan: Plan) -> bytes:
        return encode_delta_response(type_url, plan.version, nonce, plan.resources.values(), plan.removed)


def encode_delta_response(type_url: str, version: str, nonce: str, resources: Iterable[VersionedResource],
                          removed: Iterable[str] = ()) -> bytes:
    """The bytes of ``DeltaDiscoveryResponse(system_version_info, resources, type_url, nonce,
    removed_resources)``, removed names sorted, from the resources' pre-encoded entries."""
    return b"".join((
        discovery_pb2.DeltaDiscoveryResponse(system_version_info=version).SerializeToString(),  # 1
        *(_delta_entry(r) for r in resources),  # 2
        discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=nonce,  # 4, 5, 6
                                             removed_resources=sorted(removed)).SerializeToString(),
    ))


def _delta_entry(resource: VersionedResource) -> bytes:
    if resource.delta_entry:
        return resource.delta_entry
    return discovery_pb2.DeltaDiscoveryResponse(resources=[discovery_pb2.Resource(
        name=resource.name, version=resource.version, resource=resource.any)]).SerializeToString()
