"""ext_proc's wire: the headers it reads and writes, and its answers as serialised ProcessingResponses.

Speed (this is the per-request path: see docs/benchmarks.md). The servicer
answers with pre-serialised bytes: constant answers are serialised once, the
pick's header entry and ``envoy.lb`` metadata are cached per ranked pick
(``PickAnswers``), and only the per-request header entries (tokens, predicted
ms) are encoded per request, in protobuf's wire format with field numbers
read from the descriptors (never hand-copied). The request headers are parsed
into a dict only if a plugin reads them (``RequestHeaders``); of the response
headers only the few ext_proc learns from are read (``read_response``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from inferlb_runtime.cache_control import CACHE_STATUS_HEADER
from inferlb_runtime.hostport import id_of_authority
from inferlb_runtime.model_routing import MODEL_HEADER
from inferlb_runtime.protowire import ONE_BYTE, len_field, varint

from .model import Reply
from .pick.cost import parse_orca, parse_server_timing, service_seconds
from .pick.costing import ORCA_INFLIGHT_KEY

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = "Process"
TOKENS_HEADER = "x-inferlb-tokens"
PREDICTED_HEADER = "x-inferlb-predicted-ms"
# On the response to the client, for observability: the primary pick and what ext_proc counted.
ENDPOINT_RESPONSE_HEADER = "x-inferlb-endpoint"
COUNTED_RESPONSE_HEADER = "x-inferlb-counted-tokens"
SERVER_TIMING_HEADER = "server-timing"
ORCA_HEADER = "endpoint-load-metrics"
# Envoy's attribute for the host that actually served (after retries), if the filter asks for it.
UPSTREAM_ATTRIBUTE = "upstream.address"
SOURCE_ATTRIBUTE = "source.address"  # the downstream client's ip:port, asked for in the filter's request_attributes
EXT_PROC_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
# The Endpoint Picker Protocol's other keys (docs/epp.md): the candidates the data plane allows (filter metadata
# sent with the request headers) and the endpoint that served (in the pick's namespace, with the response).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# The largest body chunk ext_proc sends back in FULL_DUPLEX_STREAMED (Envoy recommends at most 64 KiB).
STREAMED_CHUNK_BYTES = 64 * 1024
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# --- protobuf wire format, for the answers built per request ---------------------------------------


def _tag(message: Any, field: str) -> bytes:
    """The key of a length-delimited field, from the descriptor (never a hand-copied number)."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_T_HEADER = _tag(base_pb2.HeaderValueOption, "header")
_T_KEY = _tag(base_pb2.HeaderValue, "key")
_T_RAW_VALUE = _tag(base_pb2.HeaderValue, "raw_value")
_APPEND_ACTION = (varint(base_pb2.HeaderValueOption.DESCRIPTOR.fields_by_name["append_action"].number << 3)
                  + varint(_OVERWRITE))
_T_SET_HEADERS = _tag(pb.HeaderMutation, "set_headers")
_T_REMOVE_HEADERS = _tag(pb.HeaderMutation, "remove_headers")
_T_HEADER_MUTATION = _tag(pb.CommonResponse, "header_mutation")
_T_COMMON = _tag(pb.BodyResponse, "response")
assert _T_COMMON == _tag(pb.HeadersResponse, "response")
T_REQUEST_HEADERS = _tag(pb.ProcessingResponse, "request_headers")
T_REQUEST_BODY = _tag(pb.ProcessingResponse, "request_body")
T_RESPONSE_HEADERS = _tag(pb.ProcessingResponse, "response_headers")
T_RESPONSE_BODY = _tag(pb.ProcessingResponse, "response_body")
T_IMMEDIATE = _tag(pb.ProcessingResponse, "immediate_response")
_T_DYNAMIC_METADATA = _tag(pb.ProcessingResponse, "dynamic_metadata")
_T_BODY_MUTATION = _tag(pb.CommonResponse, "body_mutation")
_T_STREAMED_RESPONSE = _tag(pb.BodyMutation, "streamed_response")
_T_STREAMED_BODY = _tag(pb.StreamedBodyResponse, "body")
_STREAMED_EOS = varint(pb.StreamedBodyResponse.DESCRIPTOR.fields_by_name["end_of_stream"].number << 3) + b"\x01"


def option_prefix(key: str) -> bytes:
    """Everything of a ``set_headers`` entry's HeaderValue before its value's length."""
    return _T_KEY + varint(len(key.encode())) + key.encode() + _T_RAW_VALUE


def option(prefix: bytes, value: bytes) -> bytes:
    """One ``set_headers`` entry (OVERWRITE_IF_EXISTS_OR_ADD) from :func:`option_prefix` and the value."""
    n = len(value)
    header = prefix + (ONE_BYTE[n] if n < 128 else varint(n)) + value
    return len_field(_T_SET_HEADERS, len_field(_T_HEADER, header) + _APPEND_ACTION)


def removal(name: str) -> bytes:
    """One ``remove_headers`` entry (it may sit among ``set_headers`` entries: field order is free)."""
    return len_field(_T_REMOVE_HEADERS, name.encode())


def phase(tag: bytes, set_headers: bytes) -> bytes:
    """A ProcessingResponse answering one phase (``tag``) with these ``set_headers`` (and ``remove_headers``)
    entries."""
    return len_field(tag, len_field(_T_COMMON, len_field(_T_HEADER_MUTATION, set_headers)))


def streamed(tag: bytes, body: bytes, end_of_stream: bool) -> bytes:
    """A FULL_DUPLEX_STREAMED body answer (``tag``: request or response body): this chunk, sent on as it is.
    In that mode Envoy forwards only what comes back, so every chunk must be echoed."""
    inner = (len_field(_T_STREAMED_BODY, body) if body else b"") + (_STREAMED_EOS if end_of_stream else b"")
    return len_field(tag, len_field(_T_COMMON, len_field(_T_BODY_MUTATION, len_field(_T_STREAMED_RESPONSE, inner))))


def streamed_body(body: bytes, end_of_stream: bool) -> list[bytes]:
    """The whole request body, held until the decision, echoed in chunks of at most
    :data:`STREAMED_CHUNK_BYTES` (the last one carrying ``end_of_stream``)."""
    if len(body) <= STREAMED_CHUNK_BYTES:
        return [streamed(T_REQUEST_BODY, body, end_of_stream)]
    view = memoryview(body)
    starts = range(0, len(body), STREAMED_CHUNK_BYTES)
    return [streamed(T_REQUEST_BODY, bytes(view[i:i + STREAMED_CHUNK_BYTES]),
                     end_of_stream and i == starts[-1]) for i in starts]


def header_entries(headers: Sequence[tuple[str, str]]) -> bytes:
    """``set_headers`` entries for these (name, value) pairs."""
    return b"".join(option(option_prefix(name), value.encode()) for name, value in headers)


def metadata(namespace: str, key: str, value: str) -> bytes:
    """``dynamic_metadata`` {namespace: {key: value}}, serialised by protobuf itself (cached per pick)."""
    struct = struct_pb2.Struct()
    struct.fields[namespace].struct_value.fields[key].string_value = value
    return len_field(_T_DYNAMIC_METADATA, struct.SerializeToString())


P_TOKENS = option_prefix(TOKENS_HEADER)
P_PREDICTED = option_prefix(PREDICTED_HEADER)
P_ENDPOINT = option_prefix(ENDPOINT_RESPONSE_HEADER)
P_COUNTED = option_prefix(COUNTED_RESPONSE_HEADER)
P_MODEL = option_prefix(MODEL_HEADER)
PICK_CACHE_MAX = 4096  # ranked picks whose header entry and metadata are kept serialised

CACHE_MISS = option(option_prefix(CACHE_STATUS_HEADER), b"miss")
# A mode_override in the response-headers answer (the filter allows overrides): Envoy sends this one
# response's body, up to its buffer limit, in one message (BUFFERED_PARTIAL: a bigger body is sent in part,
# never failed, and is then not cached). The other phases stay as configured.
_MODE = processing_mode_pb2.ProcessingMode
READ_RESPONSE_BODY = pb.ProcessingResponse(mode_override=_MODE(
    request_header_mode=_MODE.SEND, request_body_mode=_MODE.BUFFERED, request_trailer_mode=_MODE.SKIP,
    response_header_mode=_MODE.SEND, response_body_mode=_MODE.BUFFERED_PARTIAL,
    response_trailer_mode=_MODE.SKIP)).SerializeToString()

# Answers that never change: serialised once.
CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
PASS_THROUGH = {
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString(),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString(),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString(),
}


# --- building answers ----------------------------------------------------------------------------


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


def headers_of(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy 1.40 sends ``raw_value`` (bytes); older ones ``value``. Keys are lower case."""
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in headers.headers.headers}


def add_headers(mutation: pb.HeaderMutation, headers: Sequence[tuple[str, str]]) -> None:
    """Append OVERWRITE_IF_EXISTS_OR_ADD entries to ``mutation.set_headers``."""
    add = mutation.set_headers.add
    for key, value in headers:
        option = add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = _OVERWRITE


_LEARN_FROM = frozenset({":status", SERVER_TIMING_HEADER, ORCA_HEADER, TOKENS_HEADER, MODEL_HEADER,
                         "content-type", "content-length"})


def response_headers_of(headers: pb.HttpHeaders) -> dict[str, str]:
    """Only the response headers ext_proc learns from."""
    out = {}
    for h in headers.headers.headers:
        key = h.key
        if key in _LEARN_FROM:
            raw = h.raw_value
            out[key] = raw.decode("latin-1") if raw else h.value
    return out


class RequestHeaders(Mapping[str, str]):
    """The request headers as a mapping, parsed from the message only if someone reads them
    (the built-in policies never do), without the stripped ones.

    The gateway cache reads ``:method``, ``:path`` and ``cache-control`` of every request: ``get`` of a
    pseudo-header scans the first entries, and with ``raw`` (the serialised message the headers came in)
    ``get`` of a header that was not sent costs a bytes search; neither parses the rest."""

    __slots__ = ("_message", "_strip", "_dict", "_raw")

    def __init__(self, message: pb.HttpHeaders, strip: Sequence[str], raw: bytes | None = None) -> None:
        self._message = message
        self._strip = strip
        self._dict: dict[str, str] | None = None
        self._raw = raw

    def _parsed(self) -> dict[str, str]:
        if self._dict is None:
            self._dict = headers_of(self._message)
            for name in self._strip:
                self._dict.pop(name, None)
        return self._dict

    def __getitem__(self, key: str) -> str:
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def __contains__(self, key: object) -> bool:
        return key in self._parsed()

    def get(self, key: str, default: Any = None) -> Any:
        if self._dict is None:
            if key.startswith(":"):  # a pseudo-header: sent once, first (HTTP/2), never stripped
                value = header_value(self._message, key)
                return default if value is None else value
            if self._raw is not None and key.isascii() and key.encode() not in self._raw:
                return default  # not in the message at all (a false positive only costs the parse)
        return self._parsed().get(key, default)

    def __eq__(self, other: object) -> bool:
        return self._parsed() == other if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return f"RequestHeaders({self._parsed()!r})"


NO_HEADERS: Mapping[str, str] = MappingProxyType({})

# The fast forms of the two response headers ext_proc learns from, as the workers write them; anything
# else takes the general parsers in cost.py. Both take the last occurrence, as the general parsers do.
COMPUTE_MS = re.compile(r"(?:^|,)\s*compute;dur=([0-9]+(?:\.[0-9]+)?)\s*(?=,|$)")
ORCA_INFLIGHT = re.compile(r"[ ,]named_metrics\.inflight=([0-9]+(?:\.[0-9]+)?)\s*(?=,|$)")


def error_body(message: str, code: str, type_: str = "server_error", param: str | None = None) -> bytes:
    """OpenAI's error shape, as the workers answer."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


NO_ENDPOINT_BODY = error_body(
    "No inference endpoint is ready: every worker is unhealthy, draining or not registered. "
    "Retry later.", "no_endpoint_ready")


def immediate(status: int, body: bytes, details: str, *headers: tuple[str, str],
              content_type: str = "application/json") -> bytes:
    """An ImmediateResponse with a JSON body. ``details`` (Envoy's response code details) starts with
    ``inferlb_``: the listener's local-reply mappers leave such replies as they are (control_plane/resources/local_reply.py)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[set_header("content-type", content_type),
                                               *(set_header(k, v) for k, v in headers)]),
        body=body,
        details=details,
    )).SerializeToString()


NO_ENDPOINT = immediate(http_status_pb2.ServiceUnavailable, NO_ENDPOINT_BODY, "inferlb_no_endpoint_ready",
                          ("retry-after", "1"))  # never changes: built once


def body_too_large_response(limit: int) -> bytes:
    """413 for a body over ``limit`` bytes, in the workers' shape (``request_too_large``)."""
    return immediate(http_status_pb2.PayloadTooLarge,
                      error_body(f"request body is over the limit of {limit} bytes", "request_too_large",
                                 "invalid_request_error"),
                      "inferlb_request_too_large")



def reply_response(reply: Reply) -> bytes:
    """An admit plugin's :class:`~ext_proc.model.Reply` as an ImmediateResponse in OpenAI's shape."""
    headers = (("retry-after", str(reply.retry_after_s)),) if reply.retry_after_s is not None else ()
    return immediate(reply.status, error_body(reply.message, reply.code, reply.type, reply.param),
                     f"inferlb_{reply.code}", *headers, *reply.headers)


def json_response(document: Any, details: str, *headers: tuple[str, str]) -> bytes:
    """A 200 ext_proc answers itself (``GET /v1/models``): the worker never sees the request."""
    return immediate(http_status_pb2.OK, orjson.dumps(document), details, *headers)


def request_headers_answer(mutation: bytes) -> bytes:
    """CONTINUE after the request headers, with ``mutation`` (entries from :func:`removal` and :func:`option`:
    the client's pick headers and API key removed, the class its key allows set)."""
    return phase(T_REQUEST_HEADERS, mutation) if mutation else CONTINUE_HEADERS


def without_pick(headers_phase: bool, mutation: bytes, tokens: int | None = None) -> bytes:
    """Fail open: no pick, Envoy's weighted least_request chooses. ``mutation`` as for
    :func:`request_headers_answer` (it is not yet applied when a GET is decided in the headers phase)."""
    if tokens is not None:
        mutation += option(P_TOKENS, str(tokens).encode())
    if not mutation:
        return CONTINUE_HEADERS if headers_phase else CONTINUE_BODY
    return phase(T_REQUEST_HEADERS if headers_phase else T_REQUEST_BODY, mutation)


class PickAnswers:
    """The answer carrying a pick: the pick header, ``envoy.lb`` metadata, tokens and predicted ms.

    The pick's header entry and metadata are cached per ranked pick (the same for any view: an endpoint id,
    host:port, always gives the same pick value); only tokens and predicted ms are encoded per request.
    """

    def __init__(self, pick_header: str, metadata_namespace: str) -> None:
        self.pick_header = pick_header
        self.metadata_namespace = metadata_namespace
        self._prefix = option_prefix(pick_header)
        self._picks: dict[tuple[str, ...], tuple[str, bytes, bytes]] = {}

    def pick(self, ranked: tuple[str, ...], pick_values: Mapping[str, str]) -> tuple[str, bytes, bytes]:
        """The pick's header value, its set_headers entry and its dynamic metadata (cached)."""
        cached = self._picks.get(ranked)
        if cached is None:
            value = ",".join([pick_values[e] for e in ranked])
            cached = (value, option(self._prefix, value.encode()),
                      metadata(self.metadata_namespace, self.pick_header, value))
            if len(self._picks) >= PICK_CACHE_MAX:
                self._picks.clear()
            self._picks[ranked] = cached
        return cached

    def answer(self, headers_phase: bool, pick_option: bytes, pick_metadata: bytes, tokens: int,
               predicted_s: float, mutation: bytes = b"", version: str | None = None) -> bytes:
        """``version``: the model version the worker must run (``x-inferlb-model``), when one was chosen."""
        if version is not None:
            mutation += option(P_MODEL, version.encode())
        return phase(T_REQUEST_HEADERS if headers_phase else T_REQUEST_BODY,
                     pick_option + option(P_TOKENS, str(tokens).encode())
                     + option(P_PREDICTED, b"%.3f" % (predicted_s * 1000)) + mutation) + pick_metadata


def response_headers_answer(served_by: str | None, tokens: int, predicted_s: float, extra: bytes = b"",
                            read_body: bool = False) -> bytes:
    """The response headers ext_proc adds: for observability, who served, what was counted and predicted
    (``served_by`` None: none of those); ``extra`` entries (the x-ratelimit-* headers); always
    ``x-inferlb-cache: miss`` (a hit never reaches this phase). ``read_body``: ask Envoy for this response's
    body (to fill the cache), for this request only (:data:`READ_RESPONSE_BODY`)."""
    if served_by is not None:
        extra = (option(P_ENDPOINT, served_by.encode()) + option(P_COUNTED, str(tokens).encode())
                 + option(P_PREDICTED, b"%.3f" % (predicted_s * 1000)) + extra)
    answer = phase(T_RESPONSE_HEADERS, CACHE_MISS + extra)
    return answer + READ_RESPONSE_BODY if read_body else answer


def cached_response(body: bytes, content_type: str, version: str, *headers: tuple[str, str]) -> bytes:
    """A gateway-cache hit: the worker's stored 200 answer, with the version that served and ``hit``."""
    return immediate(http_status_pb2.OK, body, "inferlb_cache_hit", (MODEL_HEADER, version),
                     (CACHE_STATUS_HEADER, "hit"), *headers, content_type=content_type)


def header_value(message: pb.HttpHeaders, name: str) -> str | None:
    """One request header's value, without parsing the others."""
    for h in message.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return None


@dataclass(slots=True)
class Learned:
    """What a worker's response headers say, for :meth:`ext_proc.pick.router.Router.learn`."""

    tokens: int | None = None  # what the worker actually ran (after truncation)
    seconds: float | None = None  # its compute time
    orca: Mapping[str, float] | None = None  # its load report
    unparsed: tuple[str, ...] = ()  # headers present but not understood: "orca", "tokens_header", "server_timing"


def read_response(headers: Mapping[str, str]) -> Learned:
    """Parse the learning headers (fast forms first, as the workers write them; else cost.py's parsers)."""
    learned = Learned()
    unparsed = []
    orca_text = headers.get(ORCA_HEADER)
    if orca_text:
        found = ORCA_INFLIGHT.findall(orca_text) if orca_text.startswith("TEXT ") else None
        if found:  # the workers' form: only the in-flight figure is used
            learned.orca = {ORCA_INFLIGHT_KEY: float(found[-1])}
        else:
            learned.orca = parse_orca(orca_text) or None
            if learned.orca is None:
                unparsed.append("orca")
    raw_tokens = headers.get(TOKENS_HEADER)
    if raw_tokens is not None:
        try:
            learned.tokens = int(raw_tokens)
        except ValueError:
            unparsed.append("tokens_header")
    timing_text = headers.get(SERVER_TIMING_HEADER)
    if timing_text:  # else not a worker's answer (or a worker without timings): no time to learn
        found = COMPUTE_MS.findall(timing_text)
        seconds = float(found[-1]) / 1000.0 if found else 0.0
        if not seconds > 0.0:  # not the workers' form, or no compute time: the general parser decides
            parsed = service_seconds(parse_server_timing(timing_text))
            seconds = parsed if parsed is not None else -1.0
            if parsed is None:
                unparsed.append("server_timing")
        if seconds >= 0.0:
            learned.seconds = seconds
    learned.unparsed = tuple(unparsed)
    return learned


def served_by(request: pb.ProcessingRequest, namespace: str) -> str | None:
    """The id of the host that answered (after a retry or a walk down the fallback list it is not the primary
    pick): the protocol's ``x-gateway-destination-endpoint-served`` in ``namespace`` when the data plane
    reports it (override_host's ``selected_host_key``), else Envoy's ``upstream.address`` attribute. Both
    write ``[ip]:port`` for IPv6; the fleet view's ids do not bracket, so the value is mapped to the id (else
    an IPv6 worker's responses would teach nothing). None when neither is there, or not ``ip:port``."""
    value = None
    if request.HasField("metadata_context"):
        reported = request.metadata_context.filter_metadata.get(namespace)
        if reported is not None:
            value = reported.fields.get(SERVED_KEY)
    if value is None:
        attributes = request.attributes.get(EXT_PROC_ATTRIBUTES_KEY)
        if attributes is None:
            return None
        value = attributes.fields.get(UPSTREAM_ATTRIBUTE)
    if value is None or not value.string_value:
        return None
    try:
        return id_of_authority(value.string_value)
    except ValueError:  # not ip:port (a pipe, an internal address): fall back to the pick
        return None


def source_host(request: pb.ProcessingRequest) -> str | None:
    """The client's address (without its port) as Envoy saw it, when the filter sends ``source.address``."""
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES_KEY)
    value = attributes.fields.get(SOURCE_ATTRIBUTE) if attributes is not None else None
    if value is None or not value.string_value:
        return None
    host, sep, port = value.string_value.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else value.string_value


@dataclass(frozen=True, slots=True)
class Subset:
    """The data plane's subset hint: only these endpoints may be picked. Entries are ``ip:port`` (``[ip]:port``)
    or a bare ``ip`` (any port of it, as GIE's reference picker reads one); anything else matches nothing."""

    ids: frozenset[str]
    hosts: frozenset[str]

    def allows(self, endpoint_id: str) -> bool:
        return endpoint_id in self.ids or (bool(self.hosts) and endpoint_id.rpartition(":")[0] in self.hosts)


def subset_hint(metadata: base_pb2.Metadata) -> Subset | None:
    """The subset in ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of strings,
    or one comma-separated string); None when the key is not set. A value of another type is an empty subset:
    the protocol forbids picking outside a subset the data plane set, so it is answered 503, never ignored."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    value = namespace.fields.get(SUBSET_KEY) if namespace is not None else None
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    texts = [value.string_value] if kind == "string_value" else \
        [v.string_value for v in value.list_value.values] if kind == "list_value" else []
    ids, hosts = set(), set()
    for text in texts:
        for entry in text.split(","):
            entry = entry.strip()
            try:
                ids.add(id_of_authority(entry))
            except ValueError:
                try:
                    hosts.add(str(ipaddress.ip_address(entry.strip("[]"))))
                except ValueError:
                    continue  # a host name or garbage: matches no endpoint
    return Subset(frozenset(ids), frozenset(hosts))
