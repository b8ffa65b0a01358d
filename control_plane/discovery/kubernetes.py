"""The Kubernetes provider: list + watch the EndpointSlices of one Service.

Uses the official ``kubernetes`` client for what it is good at (kubeconfig and
in-cluster configuration, authentication, TLS) and reads the list and the
watch stream as plain JSON, so the translation (``endpointslices.py``) sees
exactly what the API server sent.

The client is synchronous, so the watch runs in a daemon thread and hands
every snapshot to the event loop with ``call_soon_threadsafe``; the loop never
blocks on the API. The protocol, as an API server speaks it:

* list ``/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` with
  ``labelSelector=kubernetes.io/service-name=NAME``: the slices and the list's
  ``resourceVersion``;
* watch from that version: ADDED / MODIFIED / DELETED carry a slice (and its
  new version), BOOKMARK only a version, ERROR a Status. A 410 Gone (as an
  ERROR event or an HTTP status: the version was compacted away) means list
  again; a stream that simply ends (server timeout) is resumed from the last
  version seen;
* anything else failing (API down, 403) reports a failure, keeps the last
  known endpoints and retries with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

from inferlb_runtime.backoff import Backoff

from .endpointslices import (
    apply_event,
    label_selector,
    read_slices,
    slice_name,
)
from .model import DiscoveryFailure, DiscoverySnapshot, DiscoveryUpdate, refused_note

log = logging.getLogger("inferlb.control_plane.discovery")

Slices = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class KubernetesTarget:
    """The Service whose EndpointSlices are the endpoints, and which of its ports the workers serve on."""

    namespace: str
    service: str
    port: str | None = None  # a port name or number; None: each slice's only/first port

    @classmethod
    def parse(cls, text: str, port: str | None = None) -> KubernetesTarget:
        namespace, sep, service = text.strip().partition("/")
        if not sep or not namespace or not service or "/" in service:
            raise ValueError(f"kubernetes service {text!r} is not namespace/name")
        return cls(namespace, service, port)


class Gone(Exception):
    """410: the resource version is too old; list again."""


class WatchError(Exception):
    """An ERROR event other than 410, or an event that is not JSON."""


def api_client(kubeconfig: Path | None = None) -> Any:
    """An ``ApiClient`` from ``kubeconfig``; without one: in-cluster, else ``$KUBECONFIG`` / ~/.kube/config."""
    from kubernetes import (  # imported here: only Kubernetes deployments pay for it
        client,
        config,
    )

    configuration = client.Configuration()
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


class EndpointSliceWatch:
    """The list/watch loop of one Service (blocking: run it in a thread, see ``KubernetesProvider``)."""

    def __init__(self, api: Any, target: KubernetesTarget, emit: Callable[[DiscoveryUpdate], None],
                 stop: threading.Event, *, backoff: Backoff | None = None, watch_timeout_s: int = 240,
                 connect_timeout_s: float = 5.0) -> None:
        from kubernetes import client

        self.discovery = client.DiscoveryV1Api(api)
        self.target = target
        self.emit = emit
        self.stop = stop
        self.backoff = backoff or Backoff()
        self.watch_timeout_s = watch_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.selector = label_selector(target.service)
        self.lists = 0  # how many times it listed (a relist after 410 counts)
        self._refused: frozenset[str] = frozenset()  # the non-IP addresses skipped last time (logged on change)

    def _snapshot(self, slices: Slices) -> DiscoverySnapshot:
        endpoints, refused = read_slices(slices.values(), self.target.port)
        self._refused = refused_note("kubernetes", refused, self._refused)
        return DiscoverySnapshot("kubernetes", endpoints)

    def _request(self, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.discovery.list_namespaced_endpoint_slice(
                self.target.namespace, label_selector=self.selector, _preload_content=False,
                _request_timeout=(self.connect_timeout_s, self.watch_timeout_s + 30), **kwargs)
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(exc.reason) from exc
            raise

    def list(self) -> tuple[dict[str, Mapping[str, Any]], str]:
        self.lists += 1
        response = self._request()
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        slices = {slice_name(item): item for item in body.get("items") or []}
        return slices, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch(self, slices: dict[str, Mapping[str, Any]], version: str) -> tuple[dict[str, Mapping[str, Any]], str]:
        """Follow one watch stream until the server ends it; the slices and version it got to."""
        from kubernetes.watch.watch import iter_resp_lines

        response = self._request(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                 timeout_seconds=self.watch_timeout_s)
        try:
            for line in iter_resp_lines(response):
                if self.stop.is_set():
                    break
                try:
                    event = json.loads(line)
                    kind, obj = event["type"], event["object"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise WatchError(f"unreadable watch event: {line[:200]!r}") from exc
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", "resource version too old"))
                    raise WatchError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                before = slices
                slices = apply_event(slices, kind, obj)
                if slices != before:
                    self.emit(self._snapshot(slices))
        finally:
            response.close()
            response.release_conn()
        return slices, version

    def run(self) -> None:
        """List, watch, resume; relist on 410; back off on failures; until ``stop`` is set."""
        failures = 0
        while not self.stop.is_set():
            try:
                slices, version = self.list()
                self.emit(self._snapshot(slices))
                failures = 0
                while not self.stop.is_set():
                    slices, version = self.watch(slices, version)
            except Gone as exc:
                log.info("watch expired (410 Gone): listing again", extra={"reason": str(exc)})
            except Exception as exc:  # noqa: BLE001 -- API down, 403, broken stream: report, keep the set, retry
                failures += 1
                self.emit(DiscoveryFailure("kubernetes", f"{type(exc).__name__}: {exc}"))
                self.stop.wait(self.backoff.delay(failures))


class KubernetesProvider:
    source = "kubernetes"

    def __init__(self, target: KubernetesTarget, kubeconfig: Path | None = None, *,
                 backoff: Backoff | None = None, watch_timeout_s: int = 240) -> None:
        self.target = target
        self.kubeconfig = kubeconfig
        self.backoff = backoff or Backoff()
        self.watch_timeout_s = watch_timeout_s

    async def updates(self) -> AsyncIterator[DiscoveryUpdate]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[DiscoveryUpdate] = asyncio.Queue()
        stop = threading.Event()

        def emit(update: DiscoveryUpdate) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, update)
            except RuntimeError:  # the loop is closed: shutting down
                stop.set()

        api = await asyncio.to_thread(api_client, self.kubeconfig)
        watch = EndpointSliceWatch(api, self.target, emit, stop, backoff=self.backoff,
                                   watch_timeout_s=self.watch_timeout_s)
        thread = threading.Thread(target=watch.run, name="kubernetes-watch", daemon=True)
        thread.start()
        try:
            while True:
                yield await queue.get()
        finally:
            stop.set()  # the thread notices between events or when its stream ends; it is a daemon
            api.close()
