"""What every operator action shares: the controller, the store, one lock, and the commit.

Every action goes the same way: validate → commit to the store → ``controller.update``
(a pure state change) → the debounced publish pushes it to every Envoy and ext_proc.
Store first: an action that answered 2xx is on disk; one whose commit failed (503
``store_unavailable``) changed nothing. Actions are serialised by the one lock, so
the store and the state never disagree about their order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..controller import Controller
from ..model import FleetState
from ..store import OperatorStore, StoreError
from .errors import ApiError

log = logging.getLogger("inferlb.control_plane.admin")


@dataclass
class Actions:
    """The controller and store the actions change, under the lock that orders them."""

    controller: Controller
    store: OperatorStore | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def commit(self, write: Callable[[OperatorStore], Awaitable[Any]]) -> Any:
        """``write`` to the store and its result (None without a store), or 503 with nothing changed."""
        if self.store is None:
            return None
        try:
            return await write(self.store)
        except StoreError as exc:
            raise store_unavailable("the change could not be saved; nothing changed", exc) from exc


def store_unavailable(message: str, exc: StoreError) -> ApiError:
    """The 503 for a failed store call, the store's error logged (under the request's id) and not in the answer.

    A store error names the database (a file path, a PostgreSQL host and user) and what the driver said: the
    operator's log is the place for that, not an HTTP body."""
    log.error(message, extra={"error": str(exc)})  # StoreError's text has the URL's secrets removed
    return ApiError(503, "store_unavailable", message,
                    {"store": "unavailable; the control plane's log has the error, under this answer's x-request-id"})


def now_us() -> float:
    """Unix time to the microsecond: what PostgreSQL's timestamptz keeps, so a reload reads back the same."""
    return round(time.time(), 6)


def replace_endpoint(endpoint_id: str, **changes: Any) -> Callable[[FleetState], FleetState]:
    """The state change that sets ``changes`` on one endpoint."""
    def change(state: FleetState) -> FleetState:
        return dataclasses.replace(state, endpoints=tuple(
            dataclasses.replace(e, **changes) if e.id == endpoint_id else e for e in state.endpoints))
    return change
