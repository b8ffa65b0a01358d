"""Envoy's own local replies, in OpenAI's error shape.

A client of inferlb talks to an OpenAI-style API: when Envoy itself answers
(no healthy upstream, a body over the limit, a timeout, a malformed request)
the answer must read like the workers' errors, not like Envoy's plain text.
These are the HTTP connection manager's response mappers that do that, and
only that: a worker's own error answer, and ext_proc's immediate responses,
pass as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from google.protobuf import struct_pb2

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from .messages import pack

CEL_FILTER = "envoy.access_loggers.extension_filters.cel"


# Envoy's local replies by status: OpenAI's error ``type`` and a ``code`` (the workers' names where they
# have one: request_too_large, internal_error), and the message when Envoy's own text is empty or vague
# (None: Envoy's text, e.g. "no healthy upstream", "upstream request timeout"; %RESPONSE_CODE_DETAILS%
# is Envoy's reason, e.g. missing_host_header).
LOCAL_REPLIES: Mapping[int, tuple[str, str, str | None]] = MappingProxyType({
    400: ("invalid_request_error", "invalid_request", "malformed request (%RESPONSE_CODE_DETAILS%)"),
    404: ("invalid_request_error", "not_found", "no route for this request"),
    408: ("invalid_request_error", "request_timeout", None),
    413: ("invalid_request_error", "request_too_large", "request body is too large"),  # with the limit: below
    431: ("invalid_request_error", "headers_too_large", None),
    500: ("server_error", "internal_error", None),
    502: ("server_error", "bad_gateway", None),
    503: ("server_error", "upstream_unavailable", None),
    504: ("server_error", "upstream_timeout", None),
})
# Any other status: by class.
OTHER_CLIENT_ERROR = ("invalid_request_error", "invalid_request")
OTHER_SERVER_ERROR = ("server_error", "internal_error")
OTHER_MESSAGE = "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
# ext_proc's immediate responses (no endpoint ready, a body over its limit) are already in OpenAI's
# shape, with their own codes; their response code details start with this, and no mapper touches them.
EXT_PROC_DETAILS_PREFIX = "inferlb_"
_NOT_FROM_EXT_PROC = f"!response.code_details.startsWith('{EXT_PROC_DETAILS_PREFIX}')"
# Envoy's ext_proc filter answering for ext_proc when it cannot be had (fail closed: require_api_keys): its
# details start with this (ext_proc_error_per-message_timeout_exceeded, ext_proc_error_gRPC_error_14{...})
# and its body is empty. The details name internal addresses, so the message says what failed, not them.
ENVOY_EXT_PROC_DETAILS_PREFIX = "ext_proc_error"
_FROM_ENVOYS_EXT_PROC_FILTER = f"response.code_details.startsWith('{ENVOY_EXT_PROC_DETAILS_PREFIX}')"
EXT_PROC_TIMEOUT = ("server_error", "gateway_timeout",
                    "the gateway's request processor (ext_proc) did not answer in time; retry later")
EXT_PROC_UNAVAILABLE = ("server_error", "gateway_unavailable",
                        "the gateway's request processor (ext_proc) is unavailable; retry later")
_RUNTIME_KEY = "inferlb.local_reply.status"  # required by the proto; nothing sets it


def _status(op: int, code: int) -> accesslog_pb2.AccessLogFilter:
    value = base_pb2.RuntimeUInt32(default_value=code, runtime_key=_RUNTIME_KEY)
    return accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(op=op, value=value)))  # type: ignore[arg-type]


def _when(expression: str, *conditions: accesslog_pb2.AccessLogFilter) -> accesslog_pb2.AccessLogFilter:
    """``conditions`` and the CEL ``expression`` (on the reply's response code details)."""
    cel = accesslog_pb2.AccessLogFilter(extension_filter=accesslog_pb2.ExtensionFilter(
        name=CEL_FILTER, typed_config=pack(cel_pb2.ExpressionFilter(expression=expression))))
    return accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(filters=[*conditions, cel]))


def _envoys_own(*conditions: accesslog_pb2.AccessLogFilter) -> accesslog_pb2.AccessLogFilter:
    """``conditions`` and: the reply is Envoy's own, not ext_proc's."""
    return _when(_NOT_FROM_EXT_PROC, *conditions)


def _openai_error(type_: str, code: str,
                  message: str | None) -> substitution_format_string_pb2.SubstitutionFormatString:
    body = struct_pb2.Struct()
    body.update({"error": {"message": message if message is not None else "%LOCAL_REPLY_BODY%", "type": type_,
                           "param": None, "code": code}})
    return substitution_format_string_pb2.SubstitutionFormatString(json_format=body)  # application/json


def build_local_reply_config(max_request_body_bytes: int | None) -> hcm_pb2.LocalReplyConfig:
    """Envoy's own error replies (413 over the body limit, 503 no healthy upstream, 504 upstream timeout,
    400 malformed, ...) as ``{"error": {"message", "type", "param": null, "code"}}``, application/json.

    Only local replies are formatted: a worker's own error answer passes as it is. ext_proc's replies
    (details ``inferlb_*``) too. Envoy's ext_proc filter answering because ext_proc timed out or could
    not be reached (fail closed) comes first, with a message of its own: Envoy's body is empty there.
    ``max_request_body_bytes``: the limit the 413 message names (None: none is configured). A pure
    function: the bench's static Envoys use the same (``MessageToDict`` of it).
    """
    op = accesslog_pb2.ComparisonFilter
    mappers = [
        hcm_pb2.ResponseMapper(filter=_when(_FROM_ENVOYS_EXT_PROC_FILTER, _status(op.EQ, 504)),
                               body_format_override=_openai_error(*EXT_PROC_TIMEOUT)),
        hcm_pb2.ResponseMapper(filter=_when(_FROM_ENVOYS_EXT_PROC_FILTER, _status(op.GE, 400)),
                               body_format_override=_openai_error(*EXT_PROC_UNAVAILABLE)),
    ]
    for status, (type_, code, message) in sorted(LOCAL_REPLIES.items()):
        if status == 413 and max_request_body_bytes is not None:
            message = f"request body is over the limit of {max_request_body_bytes} bytes"
        mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.EQ, status)),
                                              body_format_override=_openai_error(type_, code, message)))
    mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.GE, 400), _status(op.LE, 499)),
                                          body_format_override=_openai_error(*OTHER_CLIENT_ERROR, OTHER_MESSAGE)))
    mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.GE, 500)),
                                          body_format_override=_openai_error(*OTHER_SERVER_ERROR, OTHER_MESSAGE)))
    # No top-level body_format: a reply no mapper matched (ext_proc's) keeps its body and content type.
    return hcm_pb2.LocalReplyConfig(mappers=mappers)
