"""Snapshots per node group, the streams watching them, and their status.

The cache knows nothing of the xDS protocol: it stores the latest snapshot of
each node group and wakes the streams of a group when it changes. Each stream
then works out, from its own protocol state, what (if anything) to send. This
is go-control-plane's split (cache apart from server) without its per-request
watch churn: a stream holds one long-lived :class:`Watch`.

Everything here runs on the event loop; ``set_snapshot`` must be called from
it (build the snapshot in a thread, set it on the loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from envoy.config.core.v3 import base_pb2

from .clients import ClientStatus, StreamRecord
from .snapshot import Snapshot

NodeGroup = Callable[[base_pb2.Node], str]

log = logging.getLogger("control_plane.xds.cache")


def default_node_group(node: base_pb2.Node) -> str:
    """Envoys of one ``--service-cluster`` share a snapshot; a node without one gets its own id."""
    return node.cluster or node.id


class Watch:
    """One stream's subscription to its group's snapshot: an event to wake it, and a close flag."""

    __slots__ = ("group", "record", "_wake", "closed", "changed_at", "lagging")

    def __init__(self, group: str, record: StreamRecord, wake: asyncio.Event) -> None:
        self.group = group
        self.record = record
        self._wake = wake
        self.closed = False
        # The type URL whose settle deadline it missed, until it has answered its last push of that type:
        # publishes do not wait for it meanwhile. None: not lagging.
        self.lagging: str | None = None
        # monotonic time of the first snapshot change not yet seen by the stream
        self.changed_at: float | None = None

    def notify(self) -> None:
        if self.changed_at is None:
            self.changed_at = time.monotonic()
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def take_changed_at(self) -> float | None:
        changed_at, self.changed_at = self.changed_at, None
        return changed_at


@dataclass(frozen=True, slots=True)
class XdsCounters:
    """Totals since start, per type URL, for /metrics."""

    pushes: Mapping[str, int]
    acks: Mapping[str, int]
    nacks: Mapping[str, int]


class SnapshotCache:
    """The latest snapshot per node group plus the streams that watch each group."""

    def __init__(self, node_group: NodeGroup = default_node_group) -> None:
        self._node_group = node_group
        self._snapshots: dict[str, Snapshot] = {}
        self._default: Snapshot | None = None
        self._watches: dict[str, set[Watch]] = {}
        self._pushes: Counter[str] = Counter()
        self._acks: Counter[str] = Counter()
        self._nacks: Counter[str] = Counter()
        self._progress = asyncio.Event()  # set on every ACK, NACK and disconnect

    # -- snapshots ---------------------------------------------------------------

    def group_of(self, node: base_pb2.Node) -> str:
        return self._node_group(node)

    def set_snapshot(self, group: str, snapshot: Snapshot) -> None:
        """Make ``snapshot`` current for ``group`` and wake that group's streams (loop thread only)."""
        watches = self._watches.get(group, ())
        if watches:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("set_snapshot must be called on the event loop that serves xDS "
                                   "(build the snapshot in a thread, set it on the loop)") from None
        previous = self._snapshots.get(group)
        self._snapshots[group] = snapshot
        if previous is not None and not snapshot.changed_types(previous):
            return  # identical content: nothing for any stream to do
        for watch in watches:
            watch.notify()

    def set_default_snapshot(self, snapshot: Snapshot) -> None:
        """The snapshot of every group that has none of its own (one fleet, many node groups).

        A node group that connects later gets it at once, without waiting for
        the controller to learn the group's name.
        """
        previous, self._default = self._default, snapshot
        if previous is not None and not snapshot.changed_types(previous):
            return
        for group, watches in self._watches.items():
            if group not in self._snapshots:
                for watch in watches:
                    watch.notify()

    def get(self, group: str) -> Snapshot | None:
        return self._snapshots.get(group, self._default)

    def groups(self) -> list[str]:
        return sorted(self._snapshots)

    def default_settled(self, type_url: str) -> bool:
        """Has every stream served by the default snapshot acknowledged (or rejected) that
        snapshot's version of ``type_url``? Streams that never asked for the type count as settled."""
        return not self._default_unsettled(type_url)

    async def wait_default_settled(self, type_url: str, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, for :meth:`default_settled`; return whether it is.

        Not waited for: streams that connect meanwhile; streams that have
        never answered (ACK or NACK) a push of ``type_url`` (Envoy serves
        nothing with a cluster until its first EDS, which it then ACKs; a
        reconnected Envoy is not waited for during its first push, so ext_proc
        may learn of an endpoint one round trip before it, and override_host
        falls back meanwhile); and laggards: a stream still pending at the
        deadline is marked lagging and not waited for again until it has
        answered the last push it was sent. So a client that never ACKs costs
        no deadline, and one that stops ACKing costs one, once, not one per
        publish. Each ACK costs one check (of the first stream still pending),
        not one per stream.
        """
        pending = collections.deque(self._default_unsettled(type_url, waited_only=True))
        version = self._default.version(type_url) if self._default is not None else ""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._progress.clear()
            while pending and self._settled(pending[0], type_url, version):
                pending.popleft()
            if not pending:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                for watch in pending:
                    if watch.lagging is None:
                        watch.lagging = type_url
                        log.warning("xDS client missed the settle deadline: publishes stop waiting for it "
                                    "until it answers", extra={"node_id": watch.record.node_id,
                                                               "stream_id": watch.record.stream_id,
                                                               "type_url": type_url, "timeout_s": timeout})
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), remaining)

    def laggards(self) -> frozenset[str]:
        """The node ids of the connected streams publishes do not wait for (see :meth:`wait_default_settled`),
        as of now: one that has answered since, or left, is none (so /metrics need not wait for a publish)."""
        return frozenset(w.record.node_id for watches in self._watches.values() for w in watches
                         if self._still_lagging(w))

    def _default_unsettled(self, type_url: str, waited_only: bool = False) -> list[Watch]:
        if self._default is None:
            return []
        version = self._default.version(type_url)
        unsettled = []
        for group, watches in self._watches.items():
            if group in self._snapshots:
                continue
            for watch in watches:
                if self._settled(watch, type_url, version):
                    watch.lagging = None
                elif not (waited_only and (self._still_lagging(watch) or not self._ever_answered(watch, type_url))):
                    unsettled.append(watch)
        return unsettled

    @staticmethod
    def _ever_answered(watch: Watch, type_url: str) -> bool:
        """Has the stream answered a push of ``type_url`` (on this stream: a client cannot claim it)?"""
        status = watch.record.status().types.get(type_url)
        return status is not None and (status.acked_version != "" or status.last_nack is not None)

    def _still_lagging(self, watch: Watch) -> bool:
        """A laggard stays one until it has answered the last push it was sent of the type it lagged on."""
        if watch.lagging is None:
            return False
        status = watch.record.status().types.get(watch.lagging)
        answered = status is None or status.acked_version == status.sent_version or (
            status.last_nack is not None and status.last_nack.version == status.sent_version)
        if answered:
            watch.lagging = None
        return not answered

    def _settled(self, watch: Watch, type_url: str, version: str) -> bool:
        if watch not in self._watches.get(watch.group, ()):
            return True  # gone
        status = watch.record.status().types.get(type_url)
        return status is None or status.acked_version == version or (
            status.last_nack is not None and status.last_nack.version == version)

    def clear_snapshot(self, group: str) -> None:
        """Forget a group's snapshot; its streams keep what they have and wait for the next one."""
        self._snapshots.pop(group, None)

    # -- streams -----------------------------------------------------------------

    def watch(self, record: StreamRecord, wake: asyncio.Event) -> Watch:
        watch = Watch(record.group, record, wake)
        self._watches.setdefault(record.group, set()).add(watch)
        return watch

    def node_ids(self, group: str) -> tuple[str, ...]:
        """The distinct node ids of ``group``'s connected streams, sorted: ext_proc replicas find their
        index among them (``resources.encode_load_assignment``'s ``replicas``)."""
        return tuple(sorted({w.record.node_id for w in self._watches.get(group, ())}))

    def metrics_targets(self, group: str) -> dict[str, tuple[str, int]]:
        """Node id -> where its /metrics is (``StreamRecord.metrics_target``), for ``group``'s streams that
        told one."""
        targets: dict[str, tuple[str, int]] = {}
        for watch in sorted(self._watches.get(group, ()), key=lambda w: w.record.stream_id):
            if watch.record.metrics_target is not None:
                targets.setdefault(watch.record.node_id, watch.record.metrics_target)
        return targets

    def unwatch(self, watch: Watch) -> None:
        watches = self._watches.get(watch.group)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.group]
        self._progress.set()

    def close_streams(self) -> None:
        """Ask every stream to end (graceful shutdown): clients reconnect elsewhere."""
        for watches in self._watches.values():
            for watch in watches:
                watch.close()

    def clients(self) -> list[ClientStatus]:
        """A frozen copy of every connected stream's status, oldest first."""
        records = [w.record for ws in self._watches.values() for w in ws]
        return [r.status() for r in sorted(records, key=lambda r: r.stream_id)]

    # -- counters (the server calls these) -----------------------------------------

    def count_push(self, type_url: str) -> None:
        self._pushes[type_url] += 1

    def count_ack(self, type_url: str) -> None:
        self._acks[type_url] += 1
        self._progress.set()

    def count_nack(self, type_url: str) -> None:
        self._nacks[type_url] += 1
        self._progress.set()

    def counters(self) -> XdsCounters:
        return XdsCounters(MappingProxyType(dict(self._pushes)), MappingProxyType(dict(self._acks)),
                           MappingProxyType(dict(self._nacks)))
