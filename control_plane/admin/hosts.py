"""The admin API's ``Host`` check, before anything else reads a request (the rule: ``host_allowlist``)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from ..host_allowlist import AllowedHosts
from .errors import error_response


class HostCheckMiddleware:
    """400 ``host_not_allowed`` (the admin API's error shape) for a Host that :class:`AllowedHosts` refuses.

    Plain ASGI, so it runs before anything else reads the request."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((value.decode("latin-1") for key, value in scope["headers"] if key == b"host"), None)
            if not self.allowed.allows(header):
                response = error_response(
                    400, "host_not_allowed",
                    "the admin API does not answer this Host: it answers localhost, IP addresses and the "
                    "names in the control plane's admin_allowed_hosts", {"host": header[:255] if header else None})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
