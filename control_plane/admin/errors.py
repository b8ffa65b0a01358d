"""The admin API's one error shape, ``{"error": {"status", "code", "message", "detail"}}``, and how it is documented.

Every failure answers in this shape, whatever raised it: an ``ApiError`` from an
operator action, FastAPI's request validation (400 for a body that is not JSON or
holds a non-finite number, 422 otherwise), Starlette's 404/405, and anything
unexpected (500, logged, never the traceback). The ``E...`` tables are the error
responses each route declares in ``/openapi.json``: which codes a status may carry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api_models import NON_FINITE, ErrorResponse

log = logging.getLogger("inferlb.control_plane.admin")


class ApiError(Exception):
    """A refused request: its status, a stable ``code`` for programs, a message for people."""

    def __init__(self, status: int, code: str, message: str, detail: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.detail, self.headers = status, code, message, detail, headers


def error_response(status: int, code: str, message: str, detail: Any = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = {"error": {"status": status, "code": code, "message": message, "detail": detail}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def api_error_response(exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)


def validation_detail(exc: ValidationError | RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": [str(part) for part in err.get("loc", ())], "msg": str(err.get("msg", "")),
             "type": str(err.get("type", ""))} for err in exc.errors()]


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return api_error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    if any(err.get("type") in ("json_invalid", NON_FINITE) for err in exc.errors()):
        return error_response(400, "invalid_json", "the body is not valid JSON", validation_detail(exc))
    return error_response(422, "validation_error", "the request does not match the schema", validation_detail(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail), None,
                          getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("admin API error", extra={"path": request.url.path})
    return error_response(500, "internal_error", "unexpected error; see the control plane's log")


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of ``app`` in the one shape."""
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


# --- what the routes declare in /openapi.json -----------------------------------------------------------

Responses = dict[int | str, dict[str, Any]]


def _errors(status: int, *codes: str) -> Responses:
    return {status: {"model": ErrorResponse, "description": ", ".join(codes)}}


def responses(*entries: Responses) -> Responses:
    """One route's error responses, from the tables below."""
    merged: Responses = {}
    for entry in entries:
        merged.update(entry)
    return merged


E400 = _errors(400, "invalid_json", "unknown_policy")
E401 = _errors(401, "unauthorized")
E404 = _errors(404, "endpoint_not_found")
E404_KEY = _errors(404, "api_key_not_found")
E409 = _errors(409, "endpoint_exists", "static_endpoint", "endpoint_removing")
E422_USAGE = _errors(422, "validation_error")
E404_ROLLOUT = _errors(404, "rollout_not_found")
E409_ROLLOUT = _errors(409, "version_not_served", "alias_is_a_version")
E409_ROLLBACK = _errors(409, "no_previous_split")
E422 = _errors(422, "validation_error", "invalid_params")
E422_KEY = _errors(422, "validation_error", "tenant_reserved")
E503 = _errors(503, "store_unavailable")
