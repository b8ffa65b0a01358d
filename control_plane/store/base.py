"""What every store keeps, the contract every store meets, and how stored state meets the fleet.

What is stored is what an operator set through the admin API, nothing the
control plane can recompute: endpoints registered by API, pins, drains, the
active weight and pick policies with their parameters, API keys (their
hash only: the key itself is shown once, when it is created, and never kept),
and model rollouts with the split each replaced (what a rollback puts back).

Two ways the stored state reaches the controller's ``FleetState``:

* :func:`restore`, at startup, before the first xDS push: Envoy never sees a
  moment of unpinned or undrained state.
* :func:`reconcile`, at run time, when another control-plane replica changed
  the shared store: the same fold, but onto a live state whose endpoints carry
  telemetry and health that must survive it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from inferlb_runtime.api_keys import KeyEntry, Quota
from inferlb_runtime.model_routing import Rollout
from inferlb_runtime.request_class import PRIORITIES, Priority

from ..model import Endpoint, FleetState, PickPolicySpec
from .usage import UsageBucket, UsageRow

log = logging.getLogger("inferlb.control_plane.store")

PolicyKind = Literal["weight", "pick"]
T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used; the message names the store and the problem."""


@dataclass(frozen=True)
class StoredPolicy:
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Override:
    pinned_weight: int | None = None
    draining: bool = False


@dataclass(frozen=True)
class StoredApiKey:
    """One API key as the store keeps it: its SHA-256 (``api_keys.hash_key``), never the key.

    ``key_hint``: the first characters after the key's prefix, so an operator can tell keys apart in a
    listing (as OpenAI's redacted keys do). Times are unix seconds; ``revoked_at`` None: live.
    """

    id: str
    tenant: str
    key_hash: str
    key_hint: str
    name: str | None = None
    priority: Priority = Priority.STANDARD
    weight: float = 1.0
    quota: Quota = Quota()
    created_at: float = 0.0
    revoked_at: float | None = None

    @property
    def live(self) -> bool:
        return self.revoked_at is None

    def entry(self) -> KeyEntry:
        """What ext_proc is told about this key (the pushed table's row)."""
        return KeyEntry(self.key_hash, self.id, self.tenant, self.priority, self.weight, self.quota)


def live_key_entries(keys: Iterable[StoredApiKey]) -> tuple[KeyEntry, ...]:
    """The table ext_proc gets: the live keys, by id."""
    return tuple(k.entry() for k in sorted(keys, key=lambda k: k.id) if k.live)


# The api_keys columns both stores write as they are, in :func:`api_key_row`'s order (then each store's
# created_at and revoked_at, in its own time type).
API_KEY_COLUMNS = ("id, tenant, key_hash, key_hint, name, priority, weight, tokens_per_minute, "
                   "requests_per_minute, max_tokens_in_flight")


def api_key_row(key: StoredApiKey) -> tuple[Any, ...]:
    """The values of :data:`API_KEY_COLUMNS`."""
    q = key.quota
    return (key.id, key.tenant, key.key_hash, key.key_hint, key.name, key.priority.name.lower(), key.weight,
            q.tokens_per_minute, q.requests_per_minute, q.max_tokens_in_flight)


def api_key_from_row(row: Sequence[Any], where: str) -> StoredApiKey:
    """A record from :func:`api_key_row`'s columns plus ``created_at`` and ``revoked_at`` (unix seconds)."""
    (key_id, tenant, key_hash, hint, name, priority, weight, tpm, rpm, in_flight, created, revoked) = row
    level = PRIORITIES.get(str(priority))
    if level is None:
        raise StoreError(f"{where}: api key {key_id}: unknown priority {priority!r}")
    return StoredApiKey(str(key_id), str(tenant), str(key_hash), str(hint), None if name is None else str(name),
                        level, float(weight), Quota(_limit(tpm), _limit(rpm), _limit(in_flight)), float(created),
                        None if revoked is None else float(revoked))


def _limit(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class StoredRollout:
    """An alias's rollout and the split it replaced: a rollback makes ``previous`` current and keeps the
    other as its previous, so a rollback of a rollback goes forward again."""

    rollout: Rollout
    previous: Rollout | None = None

    @property
    def alias(self) -> str:
        return self.rollout.alias


@dataclass(frozen=True)
class OperatorState:
    """Everything in the store, as plain values."""

    endpoints: tuple[tuple[str, int], ...] = ()  # registered by API: (address, port), in registration order
    overrides: Mapping[str, Override] = field(default_factory=dict)  # endpoint id -> pin / drain
    weight_policy: StoredPolicy | None = None
    pick_policy: StoredPolicy | None = None
    api_keys: tuple[StoredApiKey, ...] = ()  # live and revoked, in creation order
    rollouts: tuple[StoredRollout, ...] = ()  # by alias

    def current_rollouts(self) -> tuple[Rollout, ...]:
        """What ``FleetState.rollouts`` holds: the current splits, by alias."""
        return tuple(sorted((r.rollout for r in self.rollouts), key=lambda r: r.alias))


@dataclass(frozen=True)
class StoreChange:
    """Why the operator state should be read again.

    ``reason``: ``connected`` (the change feed (re)connected: anything may have
    been missed), ``notified`` (a replica committed a change), ``periodic`` (the
    safety-net reload). ``origin``: the replica that made a notified change.
    """

    reason: Literal["connected", "notified", "periodic"]
    origin: str | None = None
    revision: int | None = None


class OperatorStore(Protocol):
    """What the control plane needs from a store (SQLite: ``Store``; PostgreSQL: ``PostgresStore``).

    Every write returns once committed and raises :class:`StoreError` when it
    could not be (the admin API answers 503 and changes nothing).
    """

    @property
    def location(self) -> str:
        """Where the state lives, for logs (no password)."""
        ...

    @property
    def replica_id(self) -> str:
        """This process's id in the change feed (it skips its own notifications)."""
        ...

    def load(self) -> OperatorState: ...

    async def aload(self) -> OperatorState: ...

    async def add_endpoint(self, address: str, port: int) -> None: ...

    async def remove_endpoint(self, endpoint_id: str) -> None: ...

    async def set_override(self, endpoint_id: str, pinned_weight: int | None, draining: bool) -> None: ...

    async def set_policies(self, policies: Mapping[PolicyKind, StoredPolicy]) -> None: ...

    async def add_api_key(self, key: StoredApiKey) -> None: ...

    async def revoke_api_key(self, key_id: str, at: float) -> StoredApiKey | None:
        """Mark the key revoked at ``at`` (a key already revoked keeps its first time); the record, or
        None if there is no such key."""
        ...

    async def set_rollout(self, record: StoredRollout) -> None:
        """Create or replace the alias's rollout (and the split a rollback would put back)."""
        ...

    async def delete_rollout(self, alias: str) -> None: ...

    async def record_usage(self, rows: Sequence[UsageRow]) -> None:
        """Upsert usage observations, keeping each counter's larger value (idempotent; ``usage``)."""
        ...

    async def usage_buckets(self, tenant: str | None, start: int, end: int, step: int) -> list[UsageBucket]:
        """Increases per tenant (all, or ``tenant``) over the minutes in [start, end), in ``step``-second
        buckets aligned to the epoch, ordered by tenant and bucket."""
        ...

    async def prune_usage(self, cutoff: int) -> int:
        """Delete usage before ``cutoff`` but the baselines later rows are measured from; how many rows."""
        ...

    def changes(self, reload_interval_s: float) -> AsyncIterator[StoreChange]:
        """Changes made by others, forever (a store nobody else writes yields nothing)."""
        ...

    def close(self) -> None: ...


class OneThreadStore:
    """The plumbing both stores share: one connection, used only by one dedicated thread, in order.

    A subclass turns its driver's errors into :class:`StoreError` in ``_guarded``
    and drops its connection in ``_disconnect`` (both run on the store thread).
    """

    def __init__(self, thread_name_prefix: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix)

    def _guarded(self, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def _disconnect(self) -> None:
        raise NotImplementedError

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the store thread and wait (startup, tests)."""
        return self._executor.submit(self._guarded, fn).result()

    async def _acall(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._guarded, fn)

    def _open_with(self, fn: Callable[[], None]) -> None:
        """Run the opening ``fn`` on the store thread; on any failure close the store and re-raise."""
        try:
            self._call(fn)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self._executor.submit(self._disconnect).result()
        except RuntimeError:  # executor already shut down
            pass
        self._executor.shutdown(wait=True)


def restore(state: FleetState, stored: OperatorState) -> FleetState:
    """``state`` (the static endpoints from the config) with the operator's state folded in.

    API endpoints already listed statically stay static. Overrides of endpoints
    that no longer exist (a static endpoint dropped from the config) are kept
    in the database, logged, and not applied. The pick policy and the rollouts
    are applied here; the weight policy is the controller's (see ``__main__``).
    """
    endpoints = list(state.endpoints)
    known = {e.id for e in endpoints}
    for address, port in stored.endpoints:
        endpoint = Endpoint(address=address, port=port, source="api")
        if endpoint.id in known:
            log.warning("registered endpoint is also static in the config: static wins",
                        extra={"endpoint": endpoint.id})
            continue
        known.add(endpoint.id)
        endpoints.append(endpoint)
    for endpoint_id in sorted(set(stored.overrides) - known):
        log.warning("stored pin/drain for an endpoint that no longer exists: kept, not applied",
                    extra={"endpoint": endpoint_id})
    endpoints = [
        dataclasses.replace(e, pinned_weight=o.pinned_weight, draining=o.draining)
        if (o := stored.overrides.get(e.id)) is not None else e
        for e in endpoints
    ]
    state = dataclasses.replace(state, endpoints=tuple(endpoints))
    if stored.pick_policy is not None:
        state = dataclasses.replace(state, pick_policy=PickPolicySpec(stored.pick_policy.name,
                                                                      dict(stored.pick_policy.params)))
    return dataclasses.replace(state, rollouts=stored.current_rollouts())


def reconcile(state: FleetState, stored: OperatorState,
              removing: frozenset[str] = frozenset()) -> tuple[FleetState, tuple[str, ...]]:
    """The live ``state`` made to agree with ``stored`` (read after another replica changed it).

    Returns the new state and the ids of API endpoints that are gone from the
    store (deregistered elsewhere): they are left as they are, for the caller
    to drain and remove the way a local deregistration does. Endpoints in
    ``removing`` (a local deregistration under way) keep their drain. Every
    other endpoint takes its pin and drain from the store (none stored: none),
    and keeps its telemetry, health and computed weight. Registrations new to
    this replica are appended. The pick policy and the rollouts are applied as in :func:`restore`.
    """
    registered = [Endpoint(address=a, port=p, source="api") for a, p in stored.endpoints]
    registered_ids = {e.id for e in registered}
    vanished = tuple(e.id for e in state.endpoints
                     if e.source == "api" and e.id not in registered_ids and e.id not in removing)
    untouched = removing.union(vanished)
    endpoints: list[Endpoint] = []
    for e in state.endpoints:
        if e.id not in untouched:
            o = stored.overrides.get(e.id, Override())
            if (e.pinned_weight, e.draining) != (o.pinned_weight, o.draining):
                e = dataclasses.replace(e, pinned_weight=o.pinned_weight, draining=o.draining)
        endpoints.append(e)
    known = {e.id for e in endpoints}
    for e in registered:
        if e.id not in known:
            o = stored.overrides.get(e.id, Override())
            endpoints.append(dataclasses.replace(e, pinned_weight=o.pinned_weight, draining=o.draining))
            known.add(e.id)
    state = dataclasses.replace(state, endpoints=tuple(endpoints))
    if stored.pick_policy is not None:
        pick = PickPolicySpec(stored.pick_policy.name, dict(stored.pick_policy.params))
        if pick != state.pick_policy:
            state = dataclasses.replace(state, pick_policy=pick)
    rollouts = stored.current_rollouts()
    if rollouts != state.rollouts:
        state = dataclasses.replace(state, rollouts=rollouts)
    return state, vanished
