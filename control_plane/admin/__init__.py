"""The control plane's HTTP side on 127.0.0.1:8080 (FastAPI): the admin REST API (``/v1/...``), the
dashboard, probes, metrics, ``/openapi.json`` and ``/docs``.

The package, top down: ``app`` assembles the routers (``routers/``, one per
route group, and ``dashboard``) with the error shape (``errors``) and the token
check (``access``); the routes call ``service.AdminService``'s parts, one per
responsibility (``endpoint_actions``, ``policy_actions``, ``tenant_actions``,
``rollout_actions``), which share ``actions`` (one lock, store first) and show
the state through ``views``.

Errors have one shape, ``{"error": {"status", "code", "message", "detail"}}``:
400 (malformed JSON, unknown policy), 401 (token), 404 (no such endpoint,
rollout or route), 405, 409 (conflicts: exists, static, being removed; a
version nobody serves, an alias that is a version, nothing to roll back to),
422 (the body fails its schema, the policy's parameter schema or the rollout's
rules), 503 (the store could not commit).
"""

from .app import create_admin_app
from .endpoint_actions import DEFAULT_DEREGISTRATION_DRAIN_S
from .errors import ApiError, error_response
from .service import AdminService

__all__ = ["DEFAULT_DEREGISTRATION_DRAIN_S", "AdminService", "ApiError", "create_admin_app", "error_response"]
