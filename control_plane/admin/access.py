"""Who needs the admin token for what, and the check (the token itself: ``control_plane.auth``).

Mutations always need ``Authorization: Bearer <token>``; so do reads of tenant
data (``/v1/api-keys``, ``/v1/usage``). Other reads are open to loopback clients
unless ``auth_reads`` is set. The check runs twice, on purpose: as a middleware
over all of ``/v1`` before the body is even read (no token, no information, and
a route that forgot its dependency is still covered), and as the routers'
dependency, which documents the bearer scheme in ``/openapi.json`` and covers
the dashboard's data routes outside ``/v1``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from fastapi import Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.types import ASGIApp

from ..auth import AdminToken, bearer, is_loopback
from .errors import ApiError, api_error_response

BEARER = HTTPBearer(auto_error=False, description="the admin token")
Credentials = typing.Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]
API_KEYS_PATH = "/v1/api-keys"
USAGE_PATH = "/v1/usage"
TENANT_DATA = (API_KEYS_PATH, USAGE_PATH)  # tenants and their quotas or usage: the token for reads too


@dataclass(frozen=True)
class AdminAccess:
    """The access rule. Without a ``token`` every request that needs one is refused: there is no open mode.

    An instance is the routers' dependency (``Depends(access)``)."""

    token: AdminToken | None
    auth_reads: bool = False

    def needs_token(self, request: Request) -> bool:
        if request.method not in ("GET", "HEAD", "OPTIONS") or request.url.path.startswith(TENANT_DATA):
            return True
        return self.auth_reads or not is_loopback(request.client.host if request.client else None)

    def check(self, request: Request) -> None:
        """401 (``ApiError``) unless the request carries the token."""
        presented = bearer(request.headers.get("authorization"))
        if presented is None:
            raise ApiError(401, "unauthorized", "this needs Authorization: Bearer <admin token>", None,
                           {"WWW-Authenticate": 'Bearer realm="inferlb"'})
        if self.token is None or not self.token.matches(presented):
            raise ApiError(401, "unauthorized", "the admin token is wrong", None,
                           {"WWW-Authenticate": 'Bearer realm="inferlb", error="invalid_token"'})

    async def __call__(self, request: Request, _: Credentials) -> None:
        if self.needs_token(request):
            self.check(request)


class TokenMiddleware(BaseHTTPMiddleware):
    """The check for all of ``/v1``, before the body is read."""

    def __init__(self, app: ASGIApp, access: AdminAccess) -> None:
        super().__init__(app)
        self.access = access

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path.startswith("/v1/") and self.access.needs_token(request):
            try:
                self.access.check(request)
            except ApiError as exc:
                return api_error_response(exc)
        return await call_next(request)
