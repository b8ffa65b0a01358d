"""From replica readings to the store: which observations to write, and the task that writes them.

:class:`UsageRecorder` decides what to write (pure bookkeeping, clock given):
each (instance, tenant) whose counters changed since the last observation
written, as the cumulative values in the current minute's row. Unchanged
counters write nothing, so an idle tenant costs no rows. Counters that went
down (a reset the process start does not show) are written again in the
next minute: the minute's row kept the larger value seen before the reset,
and the next row, lower, is what the store takes as the reset. It bounds what one
replica can make the store keep: at most :data:`MAX_ROWS_PER_REPLICA_MINUTE`
rows per node id and minute (a replica that restarted within the minute
writes its tenants twice); beyond that the rest waits for the next minute.
Its memory holds the instances of the last look only.

:class:`UsageIngest` is the task: the replica watch hands it each look
(:meth:`UsageIngest.offer`, never blocking the watch), it writes the
latest one (a slow store skips looks, not usage: the counters are
cumulative), forgets nothing it could not write, and deletes buckets past
the retention once an hour.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..store import OperatorStore, StoreError, UsageRow
from .readings import MAX_TENANTS, ReplicaUsage

log = logging.getLogger("inferlb.control_plane.usage")

MAX_ROWS_PER_REPLICA_MINUTE = 2 * MAX_TENANTS
MAX_NODE_ID_CHARS = 128  # a longer node id is kept as its hash
PRUNE_EVERY_S = 3600.0
DAY_S = 86400


def instance_key(node_id: str, started_at: float | None) -> str:
    """The instance a replica's counters belong to: its node id and its process start (a restart is a new
    instance, counting from zero); without a start time, the node id alone (a reset is then only seen as a
    counter going down)."""
    if len(node_id) > MAX_NODE_ID_CHARS:
        node_id = "sha256:" + hashlib.sha256(node_id.encode("utf-8", "surrogateescape")).hexdigest()
    return node_id if started_at is None else f"{node_id}@{started_at:.2f}"


@dataclass
class UsageRecorder:
    """What each look adds to the store; see the module docstring."""

    max_rows_per_replica_minute: int = MAX_ROWS_PER_REPLICA_MINUTE
    # (instance, tenant) -> the counters last written, and the minute of a reset not yet in a later row
    _written: dict[tuple[str, str], tuple[tuple[int, ...], int | None]] = field(default_factory=dict)
    _budget: dict[str, tuple[int, int]] = field(default_factory=dict)  # node id -> (minute, rows written)
    _refused: dict[str, int] = field(default_factory=dict)  # node id -> series left out of its last look

    def rows(self, readings: Mapping[str, ReplicaUsage], now: float) -> list[UsageRow]:
        """The observations of this look worth writing (call :meth:`written` once they are)."""
        minute = int(now // 60) * 60
        rows: list[UsageRow] = []
        for node, usage in sorted(readings.items()):
            if usage.refused and usage.refused != self._refused.get(node):  # once per change, not per look
                log.warning("ext_proc replica's usage series left out (bad tenant, outcome or value, or over "
                            "the tenant cap)", extra={"replica": node, "refused": usage.refused})
            self._refused[node] = usage.refused
            instance = instance_key(node, usage.started_at)
            spent_minute, spent = self._budget.get(node, (minute, 0))
            spent = spent if spent_minute == minute else 0
            changed = [UsageRow(instance, tenant, minute, counters)
                       for tenant, counters in sorted(usage.tenants.items())
                       if self._worth_writing(self._written.get((instance, tenant)), counters, minute)]
            allowed = max(0, self.max_rows_per_replica_minute - spent)
            if len(changed) > allowed:
                if allowed:  # the look that reaches the cap, not every look after it
                    log.warning("ext_proc replica over its usage rows for this minute: the rest waits for the next",
                                extra={"replica": node, "rows": len(changed), "allowed": allowed})
                changed = changed[:allowed]
            self._budget[node] = (minute, spent + len(changed))
            rows.extend(changed)
        self._budget = {node: spent for node, spent in self._budget.items() if node in readings}
        self._refused = {node: refused for node, refused in self._refused.items() if node in readings}
        return rows

    @staticmethod
    def _worth_writing(last: tuple[tuple[int, ...], int | None] | None, counters: tuple[int, ...],
                       minute: int) -> bool:
        if last is None:
            return True
        seen, reset_minute = last
        return counters != seen or (reset_minute is not None and minute > reset_minute)

    def written(self, rows: list[UsageRow], readings: Mapping[str, ReplicaUsage]) -> None:
        """``rows`` are in the store; forget the instances not in ``readings`` (gone, restarted, unreadable)."""
        for row in rows:
            key = (row.instance, row.tenant)
            last = self._written.get(key)
            reset_minute = None
            if last is not None and any(now < before for now, before in zip(row.counters, last[0])):
                reset_minute = row.minute
            elif last is not None and last[1] is not None and row.minute <= last[1]:
                reset_minute = last[1]  # still the reset's minute: its row kept the larger values
            self._written[key] = (row.counters, reset_minute)
        live = {instance_key(node, usage.started_at) for node, usage in readings.items()}
        self._written = {key: seen for key, seen in self._written.items() if key[0] in live}


class UsageIngest:
    """The usage writer: fed by the replica watch, writes to ``store``, prunes past ``retention_days``."""

    def __init__(self, store: OperatorStore, retention_days: float, *, clock: Callable[[], float] = time.time,
                 prune_every_s: float = PRUNE_EVERY_S) -> None:
        self.store = store
        self.retention_s = retention_days * DAY_S
        self.recorder = UsageRecorder()
        self._clock = clock
        self._prune_every_s = prune_every_s
        self._latest: tuple[Mapping[str, ReplicaUsage], float] | None = None
        self._offered = asyncio.Event()
        self._failing = False

    def offer(self, readings: Mapping[str, ReplicaUsage]) -> None:
        """One look at the replicas (node id -> usage); replaces a look not yet written."""
        self._latest = (dict(readings), self._clock())
        self._offered.set()

    async def write_latest(self) -> int:
        """Write the latest look now; the rows written (0 if there was nothing, or the store failed)."""
        if self._latest is None:
            return 0
        readings, at = self._latest
        self._latest = None
        rows = self.recorder.rows(readings, at)
        try:
            if rows:
                await self.store.record_usage(rows)
        except StoreError as exc:
            if not self._failing:
                log.error("usage not written: kept for the next look", extra={"error": str(exc)})
            self._failing = True
            return 0
        if self._failing:
            log.info("usage written again")
        self._failing = False
        self.recorder.written(rows, readings)
        return len(rows)

    async def prune(self) -> int:
        """Delete the buckets past the retention; the rows deleted."""
        cutoff = int((self._clock() - self.retention_s) // 60) * 60
        deleted = await self.store.prune_usage(cutoff)
        if deleted:
            log.info("usage past the retention deleted", extra={"rows": deleted, "cutoff": cutoff})
        return deleted

    async def run(self) -> None:
        """Until cancelled: write each look as it comes; prune at start and every ``prune_every_s``."""
        loop = asyncio.get_running_loop()
        next_prune = loop.time()
        while True:
            if loop.time() >= next_prune:
                try:
                    await self.prune()
                except StoreError as exc:
                    log.error("usage retention failed: trying again later", extra={"error": str(exc)})
                next_prune = loop.time() + self._prune_every_s
            try:
                await asyncio.wait_for(self._offered.wait(), timeout=max(0.0, next_prune - loop.time()))
            except TimeoutError:
                continue
            self._offered.clear()
            await self.write_latest()
