"""Envoy's access log: one JSON line per request on Envoy's stdout, keyed by ``request_id``.

Why: the services stamp ``request_id`` (Envoy's ``x-request-id``) on every line they write for a request
(``inferlb_runtime/logs.py``); Envoy's line is the one that says how the request ended at the edge (status,
Envoy's response flags, the upstream that served, time, the cache's verdict), so grepping one id across the
components' logs tells the whole story. Envoy writes it from its own flush thread, off the request path.
"""

from __future__ import annotations

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import substitution_format_string_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from google.protobuf import struct_pb2

from .messages import pack

STDOUT_ACCESS_LOG = "envoy.access_loggers.stdout"

# The line's fields: the services' names where they have one (ts, component, request_id).
FIELDS = {
    "ts": "%START_TIME%",
    "component": "envoy",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "trace_id": "%TRACE_ID%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "upstream": "%UPSTREAM_HOST%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "cache": "%RESP(X-INFERLB-CACHE)%",
    "model": "%RESP(X-INFERLB-MODEL)%",
}


def build_access_log() -> accesslog_pb2.AccessLog:
    """The HTTP connection manager's access log: ``FIELDS`` as one JSON object per request on stdout."""
    line = struct_pb2.Struct()
    line.update(FIELDS)
    return accesslog_pb2.AccessLog(name=STDOUT_ACCESS_LOG, typed_config=pack(stream_pb2.StdoutAccessLog(
        log_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=line))))
