"""The admin app: the FastAPI application on 127.0.0.1:8080 that includes every admin router.

Here only the assembly: the error handlers (``errors``), the token check and
the request ids (``access``, ``RequestContextMiddleware``), and the routers
in the order their routes are matched and documented.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from inferlb_runtime.request_context import RequestContextMiddleware

from ..auth import AdminToken
from ..controller import Controller
from ..host_allowlist import AllowedHosts
from ..metrics import ControlPlaneMetrics
from ..nginx.applier import NginxApplier
from .access import AdminAccess, TokenMiddleware
from .dashboard import dashboard_router
from .errors import install_error_handlers
from .hosts import HostCheckMiddleware
from .routers.dataplane import dataplane_router
from .routers.endpoints import endpoints_router
from .routers.models import models_router
from .routers.policy import policy_router
from .routers.probes import probes_router
from .routers.tenants import api_keys_router, usage_router
from .routers.xds import xds_router
from .service import AdminService

DESCRIPTION = """\
inferlb's control plane: see and override what it decides.

Every mutation needs `Authorization: Bearer <token>` (the token is in
`<data_dir>/admin-token` unless configured). Reads are open from loopback
unless `admin_auth_reads` is set; `/v1/api-keys` and `/v1/usage` always need it. Changes reach every Envoy and ext_proc
through xDS within about a second, and survive restarts. A `Host` other than
localhost, an IP address or a name in `admin_allowed_hosts` gets 400
`host_not_allowed` (DNS rebinding).

Errors: `{"error": {"status", "code", "message", "detail"}}`.
"""


def create_admin_app(controller: Controller, metrics: ControlPlaneMetrics, service: AdminService | None = None,
                     token: AdminToken | None = None, *, auth_reads: bool = False,
                     allowed_hosts: AllowedHosts = AllowedHosts(),
                     nginx: NginxApplier | None = None) -> FastAPI:
    """The HTTP app. Without a ``token`` every mutation is refused (401): there is no open mode."""
    service = service or AdminService(controller)
    access = AdminAccess(token, auth_reads)
    app = FastAPI(title="inferlb control plane", version="0.1.0", description=DESCRIPTION)
    app.add_middleware(TokenMiddleware, access=access)
    # Before the token check: a rebound name learns nothing, not even whether it needs a token.
    app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    # Outermost (added after the token check): every answer, a 401 too, carries the request's id
    # (x-request-id as sent, else a fresh one), and so do the log lines written for it.
    app.add_middleware(RequestContextMiddleware, generate_id=True, echo_id=True)
    install_error_handlers(app)

    auth = [Depends(access)]
    app.include_router(probes_router(controller, metrics, nginx))
    app.include_router(dashboard_router(service, auth))  # /dashboard: the page and its live feed
    app.include_router(endpoints_router(service.endpoint_actions, auth))
    app.include_router(policy_router(service.policy_actions, auth))
    app.include_router(xds_router(controller, auth))
    app.include_router(api_keys_router(service.tenant_actions, auth))
    app.include_router(usage_router(service.tenant_actions, auth))
    app.include_router(models_router(service.rollout_actions, auth))
    app.include_router(dataplane_router(nginx, auth))
    return app

