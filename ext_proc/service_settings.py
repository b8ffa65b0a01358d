"""What the ext_proc servicer needs from the configuration (``config.py`` holds the operator's settings)."""

from __future__ import annotations

from dataclasses import dataclass

from .admission.gate import GateSettings
from .admission.rules import AdmissionRules
from .stages.operator import OperatorStageSpec


@dataclass(frozen=True)
class ServiceSettings:
    """What the servicer needs from the configuration."""

    pick_header: str = "x-gateway-destination-endpoint"
    pick_metadata_namespace: str = "envoy.lb"
    response_headers: bool = True
    # The most request body a stream may buffer: Envoy's own limit (the route's request_body_buffer_limit).
    max_body_bytes: int = 4 * 1024 * 1024
    # A request without a known API key is refused (401) rather than served as the anonymous tenant.
    require_api_keys: bool = False
    # Fair admission: requests in flight per routable endpoint (of this replica's share) before new ones wait
    # in the fair queue (0: no queue), and the queue's bounds.
    fair_queue_depth: int = 0
    fair_queue: GateSettings = GateSettings()
    # How the door measures room and flows (its depth is fair_queue_depth); the defaults here are the rules
    # before size-aware admission (tests state what they change); the configuration's are config.py's.
    admission: AdmissionRules = AdmissionRules(room="requests", flows="one", early_refusal=False)
    # A newly routable endpoint's share of the picks ramps up over this many seconds (0: no slow start).
    slow_start_s: float = 0.0
    # The gateway cache (in process): its byte bound (0: off), an entry's lifetime and largest size, and
    # whether tenants share answers (False) or each has its own (True).
    cache_max_bytes: int = 0
    cache_ttl_s: float = 300.0
    cache_max_entry_bytes: int = 1024 * 1024
    cache_per_tenant: bool = False
    # The paths a request with a body may be POSTed to (the inference API the workers serve); another: 404.
    inference_paths: tuple[str, ...] = ("/v1/embeddings",)
    # The operator's own request stages (ext_proc/stages/operator.py), loaded under the policies' allowlist.
    stages: tuple[OperatorStageSpec, ...] = ()
