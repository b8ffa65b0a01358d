"""Answer inputs from the worker's cache, join identical inputs already computing, and queue only the rest.

Why it sits in front of the batcher queue rather than inside it: a cached
input must cost no queue slot, no batch room and no place in the priority
order; only the misses are queued, so a request of 100 inputs with 30 cached
runs 70 through the model.

Coalescing: the first request to queue an input (the leader) registers a
future for its key; an identical input arriving while it computes (in the
same request or another) waits on that future instead of computing again.
If the leader's request fails or is cancelled before the input is done, its
followers are released with nothing and queue the input themselves, so a
client who leaves never fails another's request. A follower waits at the
leader's priority and deadline: it asked for the same work, and the leader
is already in the queue ahead of it. So a follower joins only a leader of its
own class or a better one: a critical input must not wait in a sheddable
request's place; it computes the input itself and leads later arrivals. And
only a leader whose deadline is no later than its own (none: no deadline), so
the input it waits for starts, if ever, before its own deadline, as if it
had queued it itself; if the leader misses its deadline, the follower queues
the input with its own.

A request with ``Cache-Control: no-cache`` or ``no-store`` neither reads the
cache nor joins another's computation (it asked for a fresh one); others may
still join its computation. ``no-store`` also keeps its results out of the
cache.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from inferlb_runtime.cache_control import NO_DIRECTIVES, CacheDirectives
from inferlb_runtime.request_class import Priority

from .batcher import Embedded
from .input_cache import CacheKey, InputCache


class Embedder(Protocol):
    """The scheduler behind the cache (``workers.service.InputScheduler``'s ``embed``)."""

    async def embed(self, inputs: Sequence[Sequence[int]], *, model: str, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded: ...


class CacheCounter(Protocol):
    """Counts what became of each input; the worker's metrics implement it."""

    def cache_results(self, *, hits: int, misses: int, coalesced: int) -> None: ...


@dataclass(frozen=True)
class _Leader:
    """An input being computed: the future its followers wait on, the class and deadline it is queued with."""

    future: asyncio.Future[np.ndarray | None]
    priority: Priority
    deadline: float | None  # perf_counter seconds; None: none

    def may_lead(self, priority: Priority, deadline: float | None) -> bool:
        """A request of ``priority`` and ``deadline`` may wait on this computation rather than queue its own."""
        return self.priority <= priority and (deadline is None or (self.deadline is not None
                                                                   and self.deadline <= deadline))


@dataclass
class _Plan:
    """How a request's inputs will be answered: rows already known, keys to compute, futures to wait on."""

    rows: list[np.ndarray | None]
    compute: dict[CacheKey, list[int]]  # key -> the request's indices it answers (in first-seen order)
    follow: dict[int, asyncio.Future[np.ndarray | None]]  # index -> another request's computation
    hits: int = 0
    coalesced: int = 0


class CachedEmbedder:
    """``embed`` as the scheduler's, with the cache and coalescing in front; a zero-byte cache turns both off."""

    def __init__(self, scheduler: Embedder, cache: InputCache, counter: CacheCounter) -> None:
        self._scheduler = scheduler
        self._cache = cache
        self._counter = counter
        self._inflight: dict[CacheKey, _Leader] = {}

    @property
    def inflight_keys(self) -> int:
        """Inputs computing now that an identical input could join."""
        return len(self._inflight)

    async def embed(self, inputs: Sequence[Sequence[int]], *, model: str, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None, policy: CacheDirectives = NO_DIRECTIVES) -> Embedded:
        if not self._cache.enabled:
            return await self._scheduler.embed(inputs, model=model, priority=priority, deadline=deadline)
        plan = self._plan([CacheKey.of(model, ids) for ids in inputs], policy, Priority(priority), deadline)
        self._counter.cache_results(hits=plan.hits, misses=len(plan.compute), coalesced=plan.coalesced)
        computed = Embedded(vectors=np.empty(0), queue_s=0.0, compute_s=0.0)  # nothing computed (all hits)
        if plan.compute:
            computed = await self._compute(plan, model, priority, deadline, policy)
        batches = computed.batches
        retry = []
        for index, future in plan.follow.items():
            row = await asyncio.shield(future)  # a follower leaving must not cancel the leader's future
            if row is None:
                retry.append(index)
            plan.rows[index] = row
        if retry:  # the leader gave up: compute these ourselves (they count again, as whatever they become)
            again = await self.embed([inputs[i] for i in retry], model=model, priority=priority,
                                     deadline=deadline, policy=CacheDirectives(no_cache=True, no_store=policy.no_store))
            for index, row in zip(retry, again.vectors):
                plan.rows[index] = row
            batches = tuple(sorted({*batches, *again.batches}))
        return Embedded(vectors=np.stack(plan.rows), queue_s=computed.queue_s, compute_s=computed.compute_s,
                        batches=batches)

    def _plan(self, keys: list[CacheKey], policy: CacheDirectives, priority: Priority,
              deadline: float | None) -> _Plan:
        plan = _Plan(rows=[None] * len(keys), compute={}, follow={})
        for index, key in enumerate(keys):
            if key in plan.compute:  # the same input twice in one request: computed once
                plan.compute[key].append(index)
                plan.coalesced += 1
                continue
            if policy.lookup:
                vector = self._cache.get(key)
                if vector is not None:
                    plan.rows[index] = vector
                    plan.hits += 1
                    continue
                leader = self._inflight.get(key)
                if leader is not None and leader.may_lead(priority, deadline):
                    plan.follow[index] = leader.future
                    plan.coalesced += 1
                    continue
            plan.compute[key] = [index]
        return plan

    async def _compute(self, plan: _Plan, model: str, priority: Priority, deadline: float | None,
                       policy: CacheDirectives) -> Embedded:
        """Queue the plan's misses as one request; publish each result to its followers and the cache."""
        loop = asyncio.get_running_loop()
        led: dict[CacheKey, _Leader] = {}
        for key in plan.compute:
            current = self._inflight.get(key)
            # One already computing (for a no-cache request, or in a worse class or with a later deadline) stays
            # the leader unless it could not have led this request: later arrivals like this one then join it.
            if current is None or not current.may_lead(priority, deadline):
                led[key] = self._inflight[key] = _Leader(loop.create_future(), Priority(priority), deadline)
        try:
            result = await self._scheduler.embed([key.ids for key in plan.compute], model=model, priority=priority,
                                                 deadline=deadline)
        except BaseException:
            self._release(led, None)
            raise
        for (key, indices), row in zip(plan.compute.items(), result.vectors):
            for index in indices:
                plan.rows[index] = row
            if policy.store:
                self._cache.put(key, row)
        self._release(led, dict(zip(plan.compute, result.vectors)))
        return result

    def _release(self, led: dict[CacheKey, _Leader], rows: dict[CacheKey, np.ndarray] | None) -> None:
        """Hand the led keys' rows to their followers (None: the leader failed; they compute it themselves)."""
        for key, leader in led.items():
            if self._inflight.get(key) is leader:
                del self._inflight[key]
            if not leader.future.done():
                leader.future.set_result(None if rows is None else rows[key])
