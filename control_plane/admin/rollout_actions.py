"""Model rollouts (``/v1/rollouts/{alias}``, issue 15): an alias's traffic split over model versions.

A PUT keeps the split it replaces as the alias's ``previous``, and a rollback
swaps the two (so a rollback of a rollback goes forward again). ext_proc gets
the rollouts on its EDS (``inferlb.rollouts``), published at once rather than
after the debounce (a rollback must be instant): the call returns when the
snapshot ext_proc is served carries it. A split naming a version no endpoint
serves is refused (409) unless ``?force=true``: a typo must not send a share
of the traffic nowhere.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

from inferlb_runtime.model_routing import Rollout

from ..api_models import ModelCatalogueOut, RolloutList, RolloutOut, RolloutPut
from ..store import StoredRollout, StoreError
from .actions import Actions, store_unavailable
from .errors import ApiError
from .views import model_catalogue, rollout_out, served_versions

log = logging.getLogger("inferlb.control_plane.admin")


class RolloutActions:
    """The rollouts with their previous splits, by alias: what the store holds (the state has the current
    splits only). Read from the store when first needed, kept up to date after."""

    def __init__(self, actions: Actions) -> None:
        self.actions = actions
        self.controller = actions.controller
        self._rollouts: dict[str, StoredRollout] | None = None  # None: not read yet

    def replace_records(self, records: Iterable[StoredRollout]) -> None:
        """The store's rollouts, after another replica's change (the state already has their splits)."""
        self._rollouts = {r.alias: r for r in records}

    async def _records(self) -> dict[str, StoredRollout]:
        """The rollouts with their previous splits (read from the store the first time: 503 if it fails)."""
        if self._rollouts is None:
            self._rollouts = {r.alias: r for r in await self._load()}
        return self._rollouts

    async def _load(self) -> tuple[StoredRollout, ...]:
        store = self.actions.store
        if store is None:
            return tuple(StoredRollout(r) for r in self.controller.state.rollouts)
        try:
            return (await store.aload()).rollouts
        except StoreError as exc:
            raise store_unavailable("the rollouts could not be read from the store", exc) from exc

    async def models(self) -> ModelCatalogueOut:
        state = self.controller.state
        return ModelCatalogueOut(models=model_catalogue(state), rollouts=(await self.rollouts()).rollouts)

    async def rollouts(self) -> RolloutList:
        records = await self._records()
        served = served_versions(self.controller.state)
        return RolloutList(rollouts=[rollout_out(records[a], served) for a in sorted(records)])

    async def rollout(self, alias: str) -> RolloutOut:
        return rollout_out(_find(await self._records(), alias), served_versions(self.controller.state))

    async def set_rollout(self, alias: str, body: RolloutPut, force: bool) -> RolloutOut:
        """Create or replace ``alias``'s split; the one it replaces becomes its ``previous``."""
        try:
            rollout = Rollout(alias, tuple((v, float(p)) for v, p in body.versions.items()), body.sticky)
        except ValueError as exc:
            raise ApiError(422, "validation_error", str(exc),
                           [{"loc": ["body", "versions"], "msg": str(exc), "type": "value_error"}]) from None
        async with self.actions.lock:
            records = await self._records()
            served = served_versions(self.controller.state)
            if alias in served:
                raise ApiError(409, "alias_is_a_version",
                               f"{alias!r} is a version an endpoint serves: a rollout of it would hide that version; "
                               "choose another alias")
            unserved = [v for v, _ in rollout.versions if v not in served]
            if unserved and not force:
                raise ApiError(409, "version_not_served",
                               f"no endpoint serves {', '.join(map(repr, unserved))}: their share of {alias!r} would "
                               "be answered 503; check the names (GET /v1/models), or add ?force=true",
                               {"unserved": unserved, "served": sorted(served)})
            current = records.get(alias)
            if current is None or current.rollout != rollout:
                await self._change(records, StoredRollout(rollout, None if current is None else current.rollout),
                                   "rollout set")
            return rollout_out(records[alias], served)

    async def delete_rollout(self, alias: str) -> RolloutOut:
        """Remove ``alias``'s rollout (and its previous split): the alias resolves as before it had one."""
        async with self.actions.lock:
            records = await self._records()
            record = _find(records, alias)
            await self.actions.commit(lambda s: s.delete_rollout(alias))
            del records[alias]
            await self._publish(records)
            log.info("rollout deleted", extra={"alias": alias, "versions": dict(record.rollout.versions)})
            return rollout_out(record, served_versions(self.controller.state))

    async def rollback(self, alias: str) -> RolloutOut:
        """Put the previous split back; the current one becomes the previous (a second rollback undoes it)."""
        async with self.actions.lock:
            records = await self._records()
            record = _find(records, alias)
            if record.previous is None:
                raise ApiError(409, "no_previous_split", f"the rollout of {alias!r} has no previous split to "
                               "roll back to (it was created by its only PUT)")
            await self._change(records, StoredRollout(record.previous, record.rollout), "rollout rolled back")
            return rollout_out(records[alias], served_versions(self.controller.state))

    async def _change(self, records: dict[str, StoredRollout], record: StoredRollout, what: str) -> None:
        await self.actions.commit(lambda s: s.set_rollout(record))
        records[record.alias] = record
        await self._publish(records)
        log.info(what, extra={"alias": record.alias, "versions": dict(record.rollout.versions),
                              "sticky": record.rollout.sticky,
                              "previous": None if record.previous is None else dict(record.previous.versions)})

    async def _publish(self, records: Mapping[str, StoredRollout]) -> None:
        """Into the state and out to ext_proc now, not after the debounce (the Envoys' snapshot is unchanged)."""
        rollouts = tuple(records[a].rollout for a in sorted(records))
        self.controller.update(lambda state: dataclasses.replace(state, rollouts=rollouts))
        await self.controller.publish()


def _find(records: Mapping[str, StoredRollout], alias: str) -> StoredRollout:
    record = records.get(alias)
    if record is None:
        raise ApiError(404, "rollout_not_found", f"no rollout of {alias!r}")
    return record
