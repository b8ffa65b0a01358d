"""Per-stream status (for the admin API) and the metrics hook the server calls.

The server owns one mutable :class:`StreamRecord` per stream and updates it as
it sends, and as the client ACKs and NACKs; the cache hands out frozen
:class:`ClientStatus` copies, so a reader never sees a half-updated record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Literal, Mapping, Protocol

Mode = Literal["sotw", "delta"]


@dataclass(frozen=True, slots=True)
class NackInfo:
    """The last rejection of one type: the version rejected, its nonce and Envoy's error text."""

    version: str
    nonce: str
    message: str
    at: float  # unix time


@dataclass(frozen=True, slots=True)
class TypeStatus:
    """One resource type on one stream. Present once the client has requested the type."""

    type_url: str
    wildcard: bool = False
    names: tuple[str, ...] = ()  # the resource names subscribed to (besides the wildcard)
    sent_version: str = ""
    sent_nonce: str = ""
    acked_version: str = ""
    last_nack: NackInfo | None = None
    nack_count: int = 0
    push_count: int = 0


@dataclass(frozen=True, slots=True)
class ClientStatus:
    """A connected xDS client (Envoy or ext_proc) as the admin API shows it."""

    stream_id: int
    node_id: str
    node_cluster: str
    group: str
    mode: Mode
    connected_at: float  # unix time
    types: Mapping[str, TypeStatus]


class XdsMetrics(Protocol):
    """What the server reports; the control plane implements it with prometheus-client."""

    def on_connect(self, mode: Mode) -> None: ...
    def on_disconnect(self, mode: Mode) -> None: ...
    def on_push(self, type_url: str, seconds: float) -> None:
        """A response went out; ``seconds`` from the change (or request) that made it due."""
    def on_ack(self, type_url: str) -> None: ...
    def on_nack(self, type_url: str) -> None: ...
    def on_refused(self, reason: str) -> None:
        """A stream was refused before it was served (``reason``: node_cluster, node_streams)."""
    def on_backpressure(self) -> None:
        """A stream's reader paused: its inbound buffer was full (a client sending faster than it is served)."""


class NoopMetrics:
    """The default :class:`XdsMetrics`: records nothing."""

    def on_connect(self, mode: Mode) -> None:
        pass

    def on_disconnect(self, mode: Mode) -> None:
        pass

    def on_push(self, type_url: str, seconds: float) -> None:
        pass

    def on_ack(self, type_url: str) -> None:
        pass

    def on_nack(self, type_url: str) -> None:
        pass

    def on_refused(self, reason: str) -> None:
        pass

    def on_backpressure(self) -> None:
        pass


@dataclass(slots=True)
class _TypeRecord:
    wildcard: bool = False
    names: tuple[str, ...] = ()
    sent_version: str = ""
    sent_nonce: str = ""
    acked_version: str = ""
    last_nack: NackInfo | None = None
    nack_count: int = 0
    push_count: int = 0


@dataclass(slots=True)
class StreamRecord:
    """Mutable status of one stream; written only by that stream's handler."""

    stream_id: int
    node_id: str
    node_cluster: str
    group: str
    mode: Mode
    connected_at: float = field(default_factory=time.time)
    # ext_proc: where its /metrics is, (the stream's peer IP, the port its node metadata names); else None.
    metrics_target: tuple[str, int] | None = None
    _types: dict[str, _TypeRecord] = field(default_factory=dict)

    def _type(self, type_url: str) -> _TypeRecord:
        record = self._types.get(type_url)
        if record is None:
            record = self._types[type_url] = _TypeRecord()
        return record

    def subscribed(self, type_url: str, wildcard: bool, names: Iterable[str]) -> None:
        record = self._type(type_url)
        record.wildcard, record.names = wildcard, tuple(sorted(names))

    def sent(self, type_url: str, version: str, nonce: str) -> None:
        record = self._type(type_url)
        record.sent_version, record.sent_nonce = version, nonce
        record.push_count += 1

    def acked(self, type_url: str, version: str) -> None:
        self._type(type_url).acked_version = version

    def nacked(self, type_url: str, version: str, nonce: str, message: str) -> None:
        record = self._type(type_url)
        record.last_nack = NackInfo(version, nonce, message, time.time())
        record.nack_count += 1

    def status(self) -> ClientStatus:
        types = {
            t: TypeStatus(t, r.wildcard, r.names, r.sent_version, r.sent_nonce, r.acked_version, r.last_nack,
                          r.nack_count, r.push_count)
            for t, r in self._types.items()
        }
        return ClientStatus(self.stream_id, self.node_id, self.node_cluster, self.group, self.mode,
                            self.connected_at, MappingProxyType(types))
