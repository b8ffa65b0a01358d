"""Request and response models of the admin REST API (v1): what ``/openapi.json`` documents.

Requests are strict (no unknown fields, integers are JSON integers, ranges
enforced); responses are what the handlers return, so the schema and the
answers cannot drift apart.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from inferlb_runtime.api_keys import KEY_PREFIX, TENANT_PATTERN
from inferlb_runtime.model_routing import MODEL_NAME_PATTERN, Sticky

from .model import MAX_WEIGHT, MIN_WEIGHT, normalise_address


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 5 and 5.0 are integers, "5" and true are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]


NON_FINITE = "non_finite_number"  # the validation error the admin API answers 400 (invalid JSON), not 422


def first_non_finite(value: Any, where: str = "") -> str | None:
    """The path of the first NaN or infinite float in a JSON-ish value, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "."
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_non_finite(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- errors ----------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    status: int = Field(description="the HTTP status, repeated")
    code: str = Field(description="a stable machine-readable code, e.g. endpoint_not_found")
    message: str = Field(description="what went wrong, for people")
    detail: Any = Field(None, description="more: the validation errors for 422, else null or an object")


class ErrorResponse(BaseModel):
    """Every error of the admin API: ``{"error": {"status", "code", "message", "detail"}}``."""

    error: ErrorBody


# --- endpoints -------------------------------------------------------------------------------------


class EndpointCreate(_Request):
    address: str = Field(max_length=64, description="the worker's IPv4 or IPv6 address",
                         examples=["127.0.0.1"])
    port: Integer = Field(ge=1, le=65535, examples=[8103])

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return normalise_address(value)


class WeightPin(_Request):
    weight: Integer = Field(ge=MIN_WEIGHT, le=MAX_WEIGHT, description="the pinned weight; it beats the policy",
                              examples=[250])


class Weights(BaseModel):
    effective: int = Field(ge=MIN_WEIGHT, le=MAX_WEIGHT, description="what Envoy uses: the pin, else the computed")
    computed: int = Field(description="the weight policy's latest")
    pinned: int | None = Field(description="the operator's pin, or null")


class TelemetryOut(BaseModel):
    """The latest smoothed telemetry from the worker's /metrics (null where not finite)."""

    cpu_utilization: float | None = Field(description="0..1 of the worker's allotted cores")
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    latency_per_token_s: float | None
    queue_wait_mean_s: float | None
    queue_depth: float | None
    inflight: float | None
    rps: float | None
    tokens_per_s: float | None
    error_rate: float | None
    slots: float | None = Field(description="jobs the worker runs at once (its inferlb_worker_slots; 1 if it "
                                            "does not say): ext_proc divides its queued work by them")
    batch_cost_fixed_s: float | None = Field(description="the worker's own batch-time fit, fixed term: "
                                                         "ext_proc's prior for the endpoint's cost")
    batch_cost_per_token_s: float | None = Field(description="the same fit, seconds per padded token")
    age_s: float = Field(description="seconds since the scrape these figures come from")
    stale: bool = Field(description="older than the freshness limit: not used as current by the policy")


class EndpointOut(BaseModel):
    id: str = Field(description="host:port", examples=["127.0.0.1:8101"])
    address: str
    port: int
    source: Literal["static", "api", "kubernetes", "dns"]
    health: Literal["unknown", "healthy", "unhealthy"]
    draining: bool
    removing: bool = Field(description="deregistered: draining, then removed")
    routable: bool = Field(description="gets new traffic: not draining and not unhealthy")
    weight: Weights
    consecutive_scrape_failures: int
    telemetry: TelemetryOut | None


class EndpointList(BaseModel):
    endpoints: list[EndpointOut]


# --- policies --------------------------------------------------------------------------------------


class PolicyChoice(_Request):
    name: str = Field(min_length=1, max_length=200, examples=["equal"])
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="the policy's parameters (see its params_schema); "
                                               "those not given take their defaults")

    @field_validator("params")
    @classmethod
    def _finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        where = first_non_finite(value)
        if where is not None:  # Python's JSON reader takes NaN and Infinity; JSON has neither
            raise PydanticCustomError(NON_FINITE, "params{where}: NaN and Infinity are not JSON numbers",
                                      {"where": where})
        return value


class PolicyUpdate(_Request):
    weight: PolicyChoice | None = Field(None, description="the weight policy (control plane)")
    pick: PolicyChoice | None = Field(None, description="the pick policy (ext_proc, via EDS metadata)")

    @model_validator(mode="after")
    def _something(self) -> PolicyUpdate:
        if self.weight is None and self.pick is None:
            raise ValueError("give weight, pick or both")
        return self


class ActivePolicy(BaseModel):
    name: str
    params: dict[str, Any] = Field(description="every parameter, defaults included")


class AvailablePolicy(BaseModel):
    name: str
    summary: str
    params_schema: dict[str, Any] = Field(description="JSON Schema of the parameters")


class AvailablePolicies(BaseModel):
    weight: list[AvailablePolicy]
    pick: list[AvailablePolicy]


class PolicyState(BaseModel):
    weight: ActivePolicy
    pick: ActivePolicy
    available: AvailablePolicies


# --- xDS clients ------------------------------------------------------------------------------------


class NackOut(BaseModel):
    version: str
    nonce: str
    message: str = Field(description="Envoy's error text")
    at: float = Field(description="unix time")


class TypeStatusOut(BaseModel):
    type_url: str
    wildcard: bool
    names: list[str]
    sent_version: str
    acked_version: str
    current_version: str = Field(description="the version in the client's snapshot now ('' if none)")
    in_sync: bool = Field(description="acked_version == current_version")
    push_count: int
    nack_count: int
    last_nack: NackOut | None


class XdsClientOut(BaseModel):
    stream_id: int
    node_id: str
    node_cluster: str
    group: str = Field(description="the snapshot group it is served from")
    mode: Literal["sotw", "delta"]
    connected_at: float = Field(description="unix time")
    types: dict[str, TypeStatusOut] = Field(description="by short type name: cds, eds, lds, rds, keys "
                                                        "(ext_proc's API key table)")


class XdsClients(BaseModel):
    clients: list[XdsClientOut]


# --- API keys --------------------------------------------------------------------------------------

PriorityName = Literal["critical", "standard", "sheddable"]
# Quotas travel to ext_proc as protobuf doubles: beyond 2**53 they would not be exact integers.
MAX_QUOTA = 2**53
KEY_HINT_LENGTH = 8
Limit = Annotated[Integer | None, Field(ge=1, le=MAX_QUOTA)]


class ApiKeyCreate(_Request):
    tenant: str = Field(pattern=TENANT_PATTERN.pattern, max_length=63, examples=["acme"],
                        description="whose counters, quotas and fair share the key's requests use (several keys "
                                    "may share a tenant); lower case, digits, '_', '.', '-'")
    name: str | None = Field(None, min_length=1, max_length=200, description="the operator's label")
    priority: PriorityName = Field("standard", description="the class of the key's requests: the default, and "
                                                          "the best a request may claim")
    weight: StrictFloat = Field(1.0, gt=0, le=1000, description="the tenant's share when the fleet is saturated")
    tokens_per_minute: Limit = Field(None, description="null: unlimited", examples=[100000])
    requests_per_minute: Limit = Field(None, description="null: unlimited", examples=[600])
    max_tokens_in_flight: Limit = Field(None, description="null: unlimited", examples=[20000])


class ApiKeyOut(BaseModel):
    """An API key as listed: never the key, nor its hash."""

    id: str = Field(examples=["key_0123456789abcdef"])
    key_hint: str = Field(description=f"the first {KEY_HINT_LENGTH} characters after {KEY_PREFIX!r}: tells keys "
                                      "apart, useless as a key")
    tenant: str
    name: str | None
    priority: PriorityName
    weight: float
    tokens_per_minute: int | None
    requests_per_minute: int | None
    max_tokens_in_flight: int | None
    created_at: float = Field(description="unix time")
    revoked_at: float | None = Field(description="unix time of the (first) revocation; null: live")
    reserved_tenant: bool = Field(False, description="true: the tenant is a name ext_proc's metrics give traffic "
                                  "without a tenant (anonymous, other), so its usage mixes with that traffic; a key "
                                  "stored before such names were refused: revoke it and issue one under another name")


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="the key, for Authorization: Bearer <key>: shown in this answer only (the "
                                 "control plane keeps its SHA-256)")


class ApiKeyList(BaseModel):
    api_keys: list[ApiKeyOut] = Field(description="oldest first")


# --- usage for billing ---------------------------------------------------------------------------------


class UsageCounts(BaseModel):
    requests: int = Field(description="the tenant's requests, whatever their outcome")
    tokens: int = Field(description="tokens of the served requests (2xx), as ext_proc counted them before "
                                    "routing: the billable figure")
    errors: int = Field(description="requests that failed: an error answer, or the stream ended first")
    sheds: int = Field(description="requests shed with 429 overloaded (sheddable, over the SLO)")
    rate_limited: int = Field(description="requests refused with 429 rate_limit_exceeded (over a quota)")
    unauthenticated: int = Field(description="requests refused for their API key (401)")


class UsageBucketOut(UsageCounts):
    start: datetime = Field(description="the bucket's start (UTC, aligned to its minute, hour or day)")


class TenantUsage(BaseModel):
    tenant: str = Field(description="the API key's tenant; anonymous: no key; other: beyond ext_proc's 1000")
    totals: UsageCounts
    buckets: list[UsageBucketOut] = Field(description="oldest first; buckets without usage are left out")


class UsageReport(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: datetime = Field(alias="from", description="the start of the first minute counted")
    to: datetime = Field(description="exclusive")
    granularity: Literal["minute", "hour", "day"]
    tenant: str | None = Field(description="the tenant asked for; null: every tenant")
    tenants: list[TenantUsage] = Field(description="by name; tenants without usage in the span are left out")


# --- data plane (NGINX mode) --------------------------------------------------------------------------


class NginxFailureOut(BaseModel):
    stage: Literal["validate", "reload", "start", "process", "extra_file"] = Field(
        description="validate: nginx -t refused the candidate; reload/start/process: nginx itself failed")
    message: str = Field(description="nginx's own error text (nginx -t's for validate)")
    digest: str | None = Field(description="sha256 of the refused candidate's files (in <config_dir>/staging)")
    at: float = Field(description="unix time")


class NginxServerOut(BaseModel):
    endpoint: str = Field(description="host:port")
    weight: int = Field(description="nginx's weight= (quantised); 0 when down")
    down: bool = Field(description="drained, unhealthy or weight 0: no new requests")
    pinned: bool


class NginxStatusOut(BaseModel):
    config_dir: str
    listen: str = Field(description="the proxy's address:port")
    manage_process: bool = Field(description="the control plane runs nginx as its child")
    running: bool
    pid: int | None = Field(description="nginx's master process")
    version: int = Field(description="configs applied since the control plane started; 0: none yet")
    digest: str | None = Field(description="sha256 of the applied config's files")
    applied_at: float | None = Field(description="unix time the applied config took effect")
    reloads: int = Field(description="graceful reloads that took effect")
    rejected: int = Field(description="candidate configs nginx -t refused (never applied)")
    cycles: int = Field(description="candidates rendered and compared with the applied config")
    pending: bool = Field(description="the current state renders a different config: it applies at the next "
                                      "reload slot (rate limit)")
    failing: bool = Field(description="the current state renders the config nginx -t refused: the last good one "
                                      "keeps serving until the state or the extra directives change")
    last_error: NginxFailureOut | None
    servers: list[NginxServerOut] = Field(description="the upstream nginx runs now")


class DataPlaneStatus(BaseModel):
    mode: Literal["envoy", "nginx"]
    nginx: NginxStatusOut | None = Field(description="null in Envoy mode")


# --- models and rollouts (issue 15) --------------------------------------------------------------------

ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN.pattern, max_length=128)]
Percent = Annotated[float, Field(strict=True, gt=0, le=100)]
MAX_ROLLOUT_VERSIONS = 16


class RolloutPut(_Request):
    versions: dict[ModelName, Percent] = Field(
        min_length=1, max_length=MAX_ROLLOUT_VERSIONS,
        description="version id -> percent of the alias's requests; positive, summing to 100. The order given is "
                    "the order requests' buckets are cut in (a sticky caller keeps its version while the split "
                    "moves past other buckets)",
        examples=[{"all-MiniLM-L6-v2-int8": 90, "all-MiniLM-L6-v2-fp32": 10}])
    sticky: Sticky = Field("none", description="none: each request on its own; api_key: every request of one API "
                                               "key lands on one version; user: the same per OpenAI 'user' field")


class RolloutSplit(BaseModel):
    versions: dict[str, float] = Field(description="version id -> percent, in order")
    sticky: Sticky


class RolloutOut(RolloutSplit):
    alias: str = Field(description="the model name requests use", examples=["all-MiniLM-L6-v2"])
    previous: RolloutSplit | None = Field(description="what POST .../rollback puts back; null: nothing")
    unserved: list[str] = Field(description="versions of this split that no endpoint serves now (set with force, "
                                            "or the fleet changed since): their share is answered 503")


class RolloutList(BaseModel):
    rollouts: list[RolloutOut] = Field(description="by alias")


class ModelEndpointOut(BaseModel):
    id: str = Field(description="host:port")
    routable: bool = Field(description="gets new traffic: not draining and not unhealthy")
    pool: str


class ModelVersionOut(BaseModel):
    id: str = Field(description="the version id", examples=["all-MiniLM-L6-v2-int8"])
    aliases: list[str] = Field(description="the names it answers to, as the endpoints serving it report them")
    routable: bool = Field(description="at least one endpoint serving it gets new traffic")
    endpoints: list[ModelEndpointOut] = Field(description="every endpoint serving it, by id")


class ModelCatalogueOut(BaseModel):
    models: list[ModelVersionOut] = Field(description="every version some endpoint reports, by id")
    rollouts: list[RolloutOut] = Field(description="by alias")
