"""ReplayedKubernetesApi: a stand-in for a Kubernetes API server, which cannot run on this machine.

A local HTTP server (127.0.0.1, a free port) that replays EndpointSlice list
and watch responses from a fixture of events (tests/fixtures/endpointslice_events.json),
speaking the part of the Kubernetes API protocol the control plane's provider
uses, so the real ``kubernetes`` client talks to it unchanged:

* ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=k=v``:
  an ``EndpointSliceList`` of the current slices matching the selector, with
  the list's ``metadata.resourceVersion``;
* the same with ``watch=true&resourceVersion=RV``: a chunked stream of
  newline-delimited JSON events (ADDED, MODIFIED, DELETED, BOOKMARK when
  ``allowWatchBookmarks``) newer than RV, then every event released later,
  until ``timeoutSeconds`` or the server stops;
* a watch from a version older than the last compaction gets
  ``{"type": "ERROR", "object": Status 410 Expired}`` and the stream ends, as
  from a real server after etcd compaction.

The test drives the timeline: ``advance()`` releases the fixture's next phase.
A phase either streams its ``events``, or is a compaction (``gone``): open
watches get the 410 and its ``unseen`` events change the state without being
streamed, so only a relist can see them. Every request is recorded
(``requests``) with its path, query and Authorization header.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, str]
    authorization: str | None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


def _rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


class ReplayedKubernetesApi:
    """See the module docstring. Use as a context manager: it always stops its server and threads."""

    def __init__(self, fixture: dict[str, Any]) -> None:
        self.namespace = fixture["namespace"]
        self.phases = list(fixture["phases"])
        self.released = 0
        self.slices: dict[str, dict[str, Any]] = {_name(s): s for s in fixture["list"]["items"]}
        self.version = int(fixture["list"]["resourceVersion"])
        self.compacted_to = 0
        self.log: list[tuple[int, dict[str, Any]]] = []  # (resource version, event) as streamed
        self.requests: list[Request] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="replayed-kubernetes-api", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ReplayedKubernetesApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting and end every open watch stream (an API server going away)."""
        with self.cond:
            if self.stopping:
                return
            self.stopping = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    # -- the timeline ---------------------------------------------------------------------------------

    def _apply(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        self.version = max(self.version, _rv(obj))
        if event["type"] in ("ADDED", "MODIFIED"):
            self.slices[_name(obj)] = obj
        elif event["type"] == "DELETED":
            self.slices.pop(_name(obj), None)

    def advance(self) -> str:
        """Release the next phase; its name."""
        with self.cond:
            phase = self.phases[self.released]
            self.released += 1
            if "gone" in phase:
                for event in phase.get("unseen", []):
                    self._apply(event)
                self.compacted_to = self.version
                self.gone_event = phase["gone"]
            for event in phase.get("events", []):
                self._apply(event)
                self.log.append((_rv(event["object"]), event))
            self.cond.notify_all()
            return phase["name"]

    def lists(self) -> int:
        return sum(1 for r in self.requests if not r.watch)

    # -- HTTP -----------------------------------------------------------------------------------------

    def _list_body(self, selector: str | None) -> bytes:
        with self.cond:
            items = [s for s in self.slices.values() if _matches(s, selector)]
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}
        return json.dumps(body).encode()

    def _stream(self, handler: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        selector = query.get("labelSelector")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def chunk(data: bytes) -> None:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()

        position = 0
        try:
            while True:
                with self.cond:
                    if since < self.compacted_to:
                        chunk(json.dumps(self.gone_event).encode() + b"\n")
                        break
                    pending = [(rv, e) for rv, e in self.log[position:] if rv > since]
                    position = len(self.log)
                    if not pending:
                        remaining = deadline - time.monotonic()
                        if self.stopping or remaining <= 0:
                            break
                        self.cond.wait(min(remaining, 0.5))
                        continue
                for rv, event in pending:
                    since = rv
                    if event["type"] == "BOOKMARK" and not bookmarks:
                        continue
                    if event["type"] != "BOOKMARK" and not _matches(event["object"], selector):
                        continue
                    chunk(json.dumps(event).encode() + b"\n")
            chunk(b"")  # the last chunk: the server ended the watch
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                request = Request(url.path, query, self.headers.get("Authorization"))
                with api.cond:
                    api.requests.append(request)
                if url.path != f"{PREFIX}{api.namespace}/endpointslices":
                    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "message": f"the server could not find {url.path}", "reason": "NotFound",
                                       "code": 404}).encode()
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if request.watch:
                    api._stream(self, query)
                    self.close_connection = True
                    return
                body = api._list_body(query.get("labelSelector"))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


def _name(obj: dict[str, Any]) -> str:
    return obj["metadata"]["name"]


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    """Equality-based label selectors (``k=v,k2=v2``), as the provider sends them."""
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True
