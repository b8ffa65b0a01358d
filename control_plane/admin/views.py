"""The admin API's views: pure functions from the domain state to the API's models (``api_models``).

Kept apart from the actions so that a read never takes the action lock and the
dashboard's view shows exactly what ``/v1`` shows. Numbers that are not finite
become null: JSON has no NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from inferlb_runtime.model_routing import Rollout

from ..policies import pick_catalogue
from ..api_models import (
    ApiKeyOut,
    AvailablePolicy,
    DataPlaneStatus,
    EndpointOut,
    ModelEndpointOut,
    ModelVersionOut,
    NackOut,
    NginxFailureOut,
    NginxServerOut,
    NginxStatusOut,
    RolloutOut,
    RolloutSplit,
    TelemetryOut,
    TypeStatusOut,
    Weights,
    XdsClientOut,
    XdsClients,
)
from ..model import Endpoint, FleetState, Telemetry
from ..nginx.applier import NginxApplier
from ..policies.registry import WeightPolicyRegistry
from ..reserved_tenants import is_reserved
from ..store import StoredApiKey, StoredRollout
from ..telemetry.parse import is_stale
from ..type_urls import SHORT_NAMES
from ..xds import SnapshotCache


def _finite(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def json_safe(value: Any) -> Any:
    """Parameters as JSON: non-finite numbers become null, unknown objects their repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return repr(value)


def telemetry_out(t: Telemetry, now: float, stale_after_s: float) -> TelemetryOut:
    return TelemetryOut(
        cpu_utilization=_finite(t.cpu_utilization), latency_mean_s=_finite(t.latency_mean_s),
        latency_p50_s=_finite(t.latency_p50_s), latency_p99_s=_finite(t.latency_p99_s),
        latency_per_token_s=_finite(t.latency_per_token_s), queue_wait_mean_s=_finite(t.queue_wait_mean_s),
        queue_depth=_finite(t.queue_depth), inflight=_finite(t.inflight), rps=_finite(t.rps),
        tokens_per_s=_finite(t.tokens_per_s), error_rate=_finite(t.error_rate), slots=_finite(t.slots),
        batch_cost_fixed_s=_finite(t.batch_cost_fixed_s), batch_cost_per_token_s=_finite(t.batch_cost_per_token_s),
        age_s=max(0.0, round(now - t.observed_at, 3)), stale=is_stale(t, now, stale_after_s),
    )


def endpoint_out(e: Endpoint, *, removing: bool, now: float, stale_after_s: float) -> EndpointOut:
    """One endpoint; ``removing``: its deregistration (drain, then remove) is under way."""
    return EndpointOut(
        id=e.id, address=e.address, port=e.port, source=e.source, health=e.health.value,
        draining=e.draining, removing=removing, routable=e.routable,
        weight=Weights(effective=e.effective_weight, computed=e.computed_weight, pinned=e.pinned_weight),
        consecutive_scrape_failures=e.consecutive_scrape_failures,
        telemetry=None if e.telemetry is None else telemetry_out(e.telemetry, now, stale_after_s),
    )


def weight_policy_catalogue() -> list[AvailablePolicy]:
    """Built-in and entry-point weight policies (``module:attribute`` ones can be named, not listed)."""
    return [AvailablePolicy(name=d["name"], summary=d["summary"], params_schema=d["params_schema"])
            for d in WeightPolicyRegistry().describe()]


def pick_policy_catalogue() -> list[AvailablePolicy]:
    """ext_proc's named policies (pick chains; their ``admit``/``filters``/``scorers`` params add plugins)."""
    return [AvailablePolicy(name=p.name, summary=p.summary, params_schema=p.schema())
            for p in sorted(pick_catalogue.CATALOGUE.values(), key=lambda p: p.name)]


def xds_clients_out(cache: SnapshotCache) -> XdsClients:
    """Every connected xDS client: per type what it was sent, what it acked, and its last NACK."""
    clients = []
    for c in cache.clients():
        snapshot = cache.get(c.group)
        types = {}
        for type_url, t in c.types.items():
            current = snapshot.version(type_url) if snapshot is not None else ""
            nack = t.last_nack
            types[SHORT_NAMES.get(type_url, type_url)] = TypeStatusOut(
                type_url=type_url, wildcard=t.wildcard, names=list(t.names), sent_version=t.sent_version,
                acked_version=t.acked_version, current_version=current,
                in_sync=bool(current) and t.acked_version == current, push_count=t.push_count,
                nack_count=t.nack_count,
                last_nack=None if nack is None else NackOut(version=nack.version, nonce=nack.nonce,
                                                            message=nack.message, at=nack.at),
            )
        clients.append(XdsClientOut(stream_id=c.stream_id, node_id=c.node_id, node_cluster=c.node_cluster,
                                    group=c.group, mode=c.mode, connected_at=c.connected_at, types=types))
    return XdsClients(clients=clients)


def api_key_out(key: StoredApiKey) -> ApiKeyOut:
    q = key.quota
    return ApiKeyOut(id=key.id, key_hint=key.key_hint, tenant=key.tenant, name=key.name,
                     priority=key.priority.name.lower(), weight=key.weight, tokens_per_minute=q.tokens_per_minute,
                     requests_per_minute=q.requests_per_minute, max_tokens_in_flight=q.max_tokens_in_flight,
                     created_at=key.created_at, revoked_at=key.revoked_at, reserved_tenant=is_reserved(key.tenant))


def _split(rollout: Rollout) -> RolloutSplit:
    return RolloutSplit(versions=dict(rollout.versions), sticky=rollout.sticky)


def rollout_out(record: StoredRollout, served: frozenset[str]) -> RolloutOut:
    """A rollout as the API shows it; ``served``: the versions some endpoint serves now."""
    r = record.rollout
    return RolloutOut(alias=r.alias, versions=dict(r.versions), sticky=r.sticky,
                      previous=None if record.previous is None else _split(record.previous),
                      unserved=[v for v, _ in r.versions if v not in served])


def served_versions(state: FleetState) -> frozenset[str]:
    """Every version some endpoint of the fleet reports, routable or not."""
    return frozenset(v for e in state.endpoints for v in e.models)


def model_catalogue(state: FleetState) -> list[ModelVersionOut]:
    """Per version: the endpoints serving it, whether any is routable, and their aliases (an endpoint reports
    its aliases for all its versions together: a version's are those of the endpoints that serve it)."""
    serving: dict[str, list[Endpoint]] = {}
    for e in sorted(state.endpoints, key=lambda e: e.id):
        for version in e.models:
            serving.setdefault(version, []).append(e)
    return [ModelVersionOut(id=version, aliases=sorted({a for e in endpoints for a in e.model_aliases}),
                            routable=any(e.routable for e in endpoints),
                            endpoints=[ModelEndpointOut(id=e.id, routable=e.routable, pool=e.pool) for e in endpoints])
            for version, endpoints in sorted(serving.items())]


def nginx_status_out(nginx: NginxApplier) -> DataPlaneStatus:
    st = nginx.status()
    error = st.last_error
    return DataPlaneStatus(mode="nginx", nginx=NginxStatusOut(
        config_dir=st.config_dir, listen=st.listen, manage_process=st.manage_process, running=st.running,
        pid=st.pid, version=st.version, digest=st.digest, applied_at=st.applied_at, reloads=st.reloads,
        rejected=st.rejected, cycles=st.cycles, pending=st.pending, failing=st.failing,
        last_error=None if error is None else NginxFailureOut(stage=error.stage, message=error.message,
                                                              digest=error.digest, at=error.at),
        servers=[NginxServerOut(endpoint=s.endpoint_id, weight=s.weight, down=s.down, pinned=s.pinned)
                 for s in st.servers],
    ))
