"""The request's pipeline: which stages run, in what order. Read this first.

```
request headers   caller ─ route ─ admission(shed unseen)
request (whole)   count ─ quota ─ models ─ cache ─ admission(fair gate) ─ [operator stages] ─ decide
response headers  quota(limits) ─ cache(fill?) ─ learn(served by)
response end      learn(learn, release) ─ cache(store, streamed)
stream end        usage ─ learn(release, if not yet) ─ admission ─ quota(give back a lease)
```

Request hooks run in this order, and the first final answer ends the request; end hooks run in reverse
order (the last stage to take the request is the first to let it go). A stage is left out when it has
nothing to do in this configuration (no cache, no operator stages), so it costs nothing per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferlb_runtime import plugins
from inferlb_runtime.plugins import PolicyAllowlist

from .cache.memory_store import ResponseCache
from .cache.redis_store import RedisResponseCache
from .metrics import ExtProcMetrics
from .pick.router import Router
from .quota import QuotaStore
from .replies import Replies
from .stage import Stages
from .stages.admission import Admission
from .stages.cache import GatewayCache
from .stages.caller import IdentifyCaller
from .stages.count import CountTokens
from .stages.decide import Decide
from .stages.learn import Learn
from .stages.models import ListModels
from .stages.operator import OperatorStage, OperatorStageSpec
from .stages.quota import Quota
from .stages.route import CheckRoute
from .stages.usage import Usage
from .tokens import TokenCounter
from .xds.fleet_view import PickPolicySpec, ViewSource

# The built-in stages an operator stage may run before (it runs after the count: it sees the counted request).
BEFORE = ("quota", "models", "cache", "admission", "decide")


@dataclass(frozen=True)
class Collaborators:
    """What the stages share: the data layer (the view), the router, the counter, the stores, the metrics."""

    source: ViewSource
    counter: TokenCounter
    router: Router
    metrics: ExtProcMetrics
    quotas: QuotaStore
    shared_cache: RedisResponseCache | None = None


def build_stages(settings: Any, c: Collaborators, policy_spec: PickPolicySpec,
                 allow: PolicyAllowlist = PolicyAllowlist()) -> Stages:
    """The pipeline for ``settings`` (a ``server.ServiceSettings``). An operator stage that cannot be loaded
    raises ValueError here, at start-up."""
    replies = Replies(c.metrics, c.source)
    cache = None
    if settings.cache_max_bytes:
        cache = GatewayCache(ResponseCache(settings.cache_max_bytes, settings.cache_ttl_s,
                                           settings.cache_max_entry_bytes),
                             c.shared_cache, settings.cache_per_tenant, c.source, c.router, c.counter, c.metrics)
    stages: list[Any] = [
        IdentifyCaller(settings.pick_header, settings.require_api_keys, c.source, c.metrics),
        CheckRoute(settings.inference_paths, c.metrics),
        CountTokens(c.counter),
        Quota(c.quotas, c.metrics),
        ListModels(c.source, c.metrics),
        cache,
        Admission(dataclasses.replace(settings.admission, depth=settings.fair_queue_depth), settings.fair_queue,
                  cache is not None, c.source, c.router, c.metrics, replies),
        Decide(settings.pick_header, settings.pick_metadata_namespace, policy_spec, c.source, c.router, c.metrics,
               replies),
        Learn(c.router, c.metrics, replies),
        Usage(c.metrics),
    ]
    stages = [stage for stage in stages if stage is not None]
    for spec in settings.stages:
        _insert(stages, OperatorStage(spec, allow, c.metrics, replies), spec)
    return Stages(stages)


def _insert(stages: list[Any], stage: OperatorStage, spec: OperatorStageSpec) -> None:
    """Before the built-in stage ``spec.before`` names (or the next one this configuration has: no cache)."""
    _check_before(spec)
    order = [s.name for s in stages if not s.name.startswith("operator:")]
    following = BEFORE[BEFORE.index(spec.before):]
    first = next(name for name in following if name in order)
    stages.insert([s.name for s in stages].index(first), stage)


def check_operator_stages(specs: Sequence[OperatorStageSpec], allow: PolicyAllowlist) -> None:
    """Load each configured stage once, at start-up, so that a bad one is refused with its reason (ValueError)
    before the service starts."""
    for spec in specs:
        _check_before(spec)
        plugins.build("stage", spec.plugin, spec.params, allow)


def _check_before(spec: OperatorStageSpec) -> None:
    if spec.before not in BEFORE:
        raise ValueError(f"operator stage {spec.plugin!r}: before={spec.before!r} is not one of {', '.join(BEFORE)}")
