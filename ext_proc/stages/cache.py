"""The gateway cache (``cache/memory_store.py``, keys in ``cache/key.py``): a repeated ``POST /v1/embeddings``
answered with the stored 200, and a miss's answer stored on its way back.

It runs once the quota is checked (a hit uses it as a served request does) and before the fair queue and the
pick. Its key names the model version, so the model is resolved here (the decision reuses the resolution
while the catalogue is the same). A miss whose answer may be stored (a 200 from the version its key names,
under the per-entry cap, no ``no-store``) gets a ``mode_override`` in the response-headers answer: Envoy
sends that one body (BUFFERED_PARTIAL: never failed for its size), which is stored, and only then does the
stream end. Under FULL_DUPLEX_STREAMED the response's chunks are gathered as they pass. The shared level
(Redis) sits behind the in-process one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from inferlb_runtime.model_routing import MODEL_HEADER

from .. import wire
from ..cache.key import cacheable_request, directives, request_key
from ..cache.memory_store import CachedResponse, ResponseCache
from ..cache.redis_store import RedisResponseCache
from ..context import Answer, RequestContext, Verdict, Wait
from ..metrics import ExtProcMetrics
from ..model import Reply
from ..pick.catalogue import ModelCatalogue
from ..pick.router import Router
from ..quota import rate_limit_headers
from ..tokens import TokenCounter
from ..xds.fleet_view import FleetView, ViewSource

log = logging.getLogger("inferlb.ext_proc")


class GatewayCache:
    name = "cache"

    def __init__(self, cache: ResponseCache, shared: RedisResponseCache | None, per_tenant: bool,
                 source: ViewSource, router: Router, counter: TokenCounter, metrics: ExtProcMetrics) -> None:
        self.cache = cache
        self.shared = shared
        self.per_tenant = per_tenant
        self.source = source
        self.router = router
        self.counter = counter
        self.metrics = metrics
        self.shared_stores: set[asyncio.Task[None]] = set()
        self._versions: frozenset[str] = frozenset()  # the catalogue's versions the cache was checked by
        metrics.cache_levels("memory")
        if shared is not None:
            metrics.cache_levels("redis")

    # -- the request: look up ---------------------------------------------------
    def on_request(self, ctx: RequestContext) -> Verdict:
        """Unresolvable (no view, nothing routable, an unknown model): routed as without a cache."""
        if ctx.bodiless or not cacheable_request(ctx.headers):
            return None
        view = self.source.view
        asked = directives(ctx.headers)
        if asked.no_store or view is None or not view.routable:
            return None
        assert ctx.request is not None
        resolved = self.router.resolve(ctx.chain_request(ctx.request), view.endpoints)
        if type(resolved) is Reply:
            return None  # the decision answers it (404, 503) as without a cache
        ctx.resolved = view.catalogue
        ctx.request = resolved
        name = resolved.version or resolved.model or ""
        tenant = ctx.caller.tenant if self.per_tenant else None
        if self.shared is None and not self.counter.needs_thread(ctx.payload):  # the fast path: all here
            hit = self._local(ctx, request_key(ctx.payload, name, tenant), asked.no_cache)
            return None if hit is None else self._answer(ctx, hit)
        return Wait(self._look_up(ctx, view, name, tenant, asked.no_cache))

    def _local(self, ctx: RequestContext, key: bytes | None, no_cache: bool) -> CachedResponse | None:
        """The in-process level's answer, with the key kept for a fill (``no-cache``: no look-up)."""
        if key is None:
            return None
        assert ctx.request is not None
        ctx.cache_key, ctx.cache_version = key, ctx.request.version
        if no_cache:
            self._looked(ctx, "memory", "bypass")
            return None
        hit = self.cache.get(key)
        self._looked(ctx, "memory", "hit" if hit is not None else "miss")
        return hit

    async def _look_up(self, ctx: RequestContext, view: FleetView, name: str, tenant: str | None,
                       no_cache: bool) -> Answer | None:
        """With a large body (parsed and hashed off the event loop) or the shared level (Redis) behind."""
        body = ctx.payload
        if self.counter.needs_thread(body):
            key = await asyncio.to_thread(request_key, body, name, tenant)
        else:
            key = request_key(body, name, tenant)
        hit = self._local(ctx, key, no_cache)
        if hit is None and self.shared is not None and key is not None and not no_cache:
            hit = await self.shared.get(key)
            if hit is not None and hit.version not in view.catalogue.versions:
                hit = None  # stored by a replica before its version left the catalogue
            self.metrics.cache_request("redis", "hit" if hit is not None else "miss")
            if hit is not None:
                self.cache.put(key, hit)  # the next one is answered here
        return None if hit is None else self._answer(ctx, hit)

    def _answer(self, ctx: RequestContext, hit: CachedResponse) -> Answer:
        ctx.outcome, ctx.forwarded, ctx.cache_key = "served", True, None  # its quota is used
        self.metrics.model_answer(hit.version, "200")  # a 200 of that version, answered here
        limits = tuple(rate_limit_headers(ctx.quota)) if ctx.quota is not None else ()
        return Answer(wire.cached_response(hit.body, hit.content_type, hit.version, *limits))

    def _looked(self, ctx: RequestContext, level: str, result: str) -> None:
        self.metrics.cache_request(level, result)
        if ctx.span is not None:
            ctx.span.set_attribute("inferlb.cache", result)

    # -- the response: store ----------------------------------------------------
    def on_response_headers(self, ctx: RequestContext) -> None:
        ctx.filling = self._fillable(ctx, ctx.response, ctx.status)
        if ctx.response_streamed:
            ctx.body_bytes = 0  # from now on: the response's

    def _fillable(self, ctx: RequestContext, headers: Mapping[str, str], status: str) -> tuple[str, str] | None:
        """(content-type, version) when this response is to be stored: a 200 from the version its key names
        (any version, for a bare alias) and not over the per-entry cap by its length."""
        if ctx.cache_key is None or status != "200":
            return None
        served = headers.get(MODEL_HEADER)
        if not served or (ctx.cache_version is not None and served != ctx.cache_version):
            return None
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or not self.cache.fits(int(length))):
            return None
        return headers.get("content-type", "application/json"), served

    def on_response_body(self, ctx: RequestContext, chunk: bytes, end: bool) -> None:
        if ctx.filling is None:
            return
        if not ctx.response_streamed:  # buffered: the whole body in one message (in part: over Envoy's limit)
            if end:
                self._store(ctx, chunk)
            ctx.filling = None
            return
        ctx.body.append(chunk)
        ctx.body_bytes += len(chunk)
        if not self.cache.fits(ctx.body_bytes):
            ctx.filling, ctx.body = None, []

    def on_response_end(self, ctx: RequestContext) -> None:
        if ctx.response_streamed:
            if ctx.filling is not None:
                self._store(ctx, b"".join(ctx.body))
            ctx.body = []

    def _store(self, ctx: RequestContext, body: bytes) -> None:
        assert ctx.filling is not None and ctx.cache_key is not None
        content_type, version = ctx.filling
        ctx.filling = None
        evictions = self.cache.evictions
        response = CachedResponse(body, content_type, version)
        if self.cache.put(ctx.cache_key, response):
            self.metrics.cache_state("memory", self.cache.bytes, self.cache.evictions - evictions)
        if self.shared is not None:  # off the stream: it is ending, and Redis is a round trip away
            task = asyncio.get_running_loop().create_task(self._share(ctx.cache_key, response))
            self.shared_stores.add(task)
            task.add_done_callback(self._shared)

    async def _share(self, key: bytes, response: CachedResponse) -> None:
        assert self.shared is not None
        stored = await self.shared.put(key, response)
        if stored is not None:
            self.metrics.cache_state("redis", *stored)

    def _shared(self, task: asyncio.Task[None]) -> None:
        self.shared_stores.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway cache: storing in Redis failed", exc_info=task.exception())

    # -- the view -----------------------------------------------------------------
    def on_view(self, view: FleetView) -> None:
        """A version the catalogue no longer lists has its answers dropped (checked only when the set of
        versions changes: EDS repeats the same catalogue with every telemetry update)."""
        self._retain(view.catalogue)

    def _retain(self, catalogue: ModelCatalogue) -> None:
        versions = frozenset(catalogue.versions)
        if versions == self._versions:
            return
        self._versions = versions
        dropped = self.cache.retain_versions(versions)
        if dropped:
            self.metrics.cache_state("memory", self.cache.bytes, 0)
            log.info("gateway cache dropped answers of versions gone from the catalogue",
                     extra={"entries": dropped, "versions": sorted(versions)})
