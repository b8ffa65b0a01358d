"""The worker's Prometheus metrics and the load figures behind its ORCA header.

The control plane scrapes these to compute weights, so they are named and
bucketed for that: queue wait apart from compute, tokens as well as requests,
and CPU as a fraction of the cores the worker is allotted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from inferlb_runtime.model_routing import DEFAULT_POOL
from inferlb_runtime.request_class import Priority

from .model_catalog import ModelInfo

LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def process_cpu_seconds(process: psutil.Process) -> Callable[[], float]:
    def read() -> float:
        times = process.cpu_times()
        return times.user + times.system

    return read


@dataclass
class LoadSampler:
    """CPU utilisation and request rate over the last sampling interval.

    Sampled on a timer rather than per request so that the ORCA header costs
    nothing on the hot path and reports a steady figure.
    """

    cpus: float
    # Cumulative busy CPU seconds; the process's own by default.
    cpu_seconds: Callable[[], float] = field(default_factory=lambda: process_cpu_seconds(psutil.Process()))
    _last_cpu: float = 0.0
    _last_time: float = 0.0
    _last_requests: float = 0.0
    cpu_utilization: float = 0.0
    rps: float = 0.0

    def __post_init__(self) -> None:
        self._last_time = time.monotonic()
        self._last_cpu = self.cpu_seconds()

    def sample(self, requests_total: float) -> None:
        now = time.monotonic()
        cpu = self.cpu_seconds()
        elapsed = now - self._last_time
        if elapsed <= 0:
            return
        self.cpu_utilization = min(1.0, max(0.0, (cpu - self._last_cpu) / (elapsed * self.cpus)))
        self.rps = max(0.0, (requests_total - self._last_requests) / elapsed)
        self._last_cpu, self._last_time, self._last_requests = cpu, now, requests_total


class WorkerMetrics:
    """All metrics of one worker, in a registry of its own (no global state)."""

    def __init__(self, *, cpus: float, models: Sequence[ModelInfo], pool: str = DEFAULT_POOL,
                 cpu_seconds: Callable[[], float] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        # By area, in this order in the exposition.
        self._register_requests_and_batches(r)
        self._register_load(r)
        self._register_facts(r, cpus, models, pool)
        self._register_per_model(r, models)
        self._register_cache(r)
        self.load = LoadSampler(cpus=cpus) if cpu_seconds is None else LoadSampler(cpus=cpus, cpu_seconds=cpu_seconds)
        self._completed = 0

    def _register_requests_and_batches(self, r: CollectorRegistry) -> None:
        """Requests, the batch queue and the batches: what the control plane's weights are computed from."""
        self.requests = Counter(
            "inferlb_worker_requests", "Embedding requests by HTTP status.", ["code"], registry=r
        )
        self.request_duration = Histogram(
            "inferlb_worker_request_duration_seconds",
            "Time from request received to response ready.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "inferlb_worker_queue_wait_seconds",
            "Time an input waited in the batch queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Apart from the unlabelled histogram above, which the control plane reads as one series.
        self.class_queue_wait = Histogram(
            "inferlb_worker_queue_wait_by_class_seconds",
            "Time an input waited in the batch queue, by the request's priority class.",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._class_queue_wait = {p: self.class_queue_wait.labels(priority=p.name.lower()) for p in Priority}
        self.compute = Histogram(
            "inferlb_worker_batch_compute_seconds",
            "Inference time of one batch.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "inferlb_worker_batch_size", "Inputs per batch.", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "inferlb_worker_batch_tokens", "Real tokens per batch.", buckets=BATCH_TOKEN_BUCKETS, registry=r
        )
        self.batch_padded_tokens = Histogram(
            "inferlb_worker_batch_padded_tokens",
            "Padded tokens per batch (what the model computes).",
            buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("inferlb_worker_tokens", "Tokens embedded.", registry=r)
        self.inputs = Counter("inferlb_worker_inputs", "Inputs (texts or token arrays) embedded.", registry=r)
        self.queue_depth_gauge = Gauge("inferlb_worker_queue_depth", "Inputs waiting for a batch.", registry=r)
        self.cancelled_inputs = Counter("inferlb_worker_cancelled_inputs",
                                        "Queued inputs dropped because their client went away.", registry=r)
        self.deadline_misses = Counter("inferlb_worker_deadline_misses",
                                       "Requests refused (504) because their deadline passed before their inputs "
                                       "could start.", registry=r)

    def _register_load(self, r: CollectorRegistry) -> None:
        """Load now: in flight, slots, CPU, rate, readiness and the fitted batch cost."""
        self.inflight = Gauge("inferlb_worker_inflight_requests", "Requests being served.", registry=r)
        # Balancers divide the work queued here over the slots: 3 in flight is a queue on a 1-slot worker
        # and a free slot on a 4-slot one (control_plane/telemetry/parse.py reads it; ext_proc/pick/costing.py uses it).
        self.slots = Gauge("inferlb_worker_slots", "Jobs (batches, or simulated requests) this worker runs at once.",
                           registry=r)
        self.slots.set(1)
        self.cpu = Gauge(
            "inferlb_worker_cpu_utilization", "Process CPU use as a fraction (0..1) of its allotted cores.", registry=r
        )
        self.rps_gauge = Gauge("inferlb_worker_requests_per_second", "Request rate over the last interval.", registry=r)
        self.ready = Gauge("inferlb_worker_ready", "1 once warm-up passed and until shutdown began.", registry=r)
        self.batch_cost = Gauge(
            "inferlb_worker_batch_cost_seconds",
            "Fitted batch time model t = per_token * padded_tokens + fixed.",
            ["term"],
            registry=r,
        )

    def _register_facts(self, r: CollectorRegistry, cpus: float, models: Sequence[ModelInfo], pool: str) -> None:
        """Static facts, set once: the worker, what it serves (for the control plane to publish,
        inferlb_runtime.model_routing) and its pool."""
        info = Gauge("inferlb_worker_info", "Static worker facts.", ["model", "cpus"], registry=r)
        info.labels(model=models[0].name, cpus=str(cpus)).set(1)
        model_info = Gauge("inferlb_worker_model_info", "A model version this worker serves, its family and the "
                           "aliases it answers to (comma-separated, sorted).", ["model", "family", "aliases"],
                           registry=r)
        for model in models:
            model_info.labels(model=model.name, family=model.family, aliases=",".join(sorted(model.aliases))).set(1)
        Gauge("inferlb_worker_pool_info", "The pool this worker belongs to.", ["pool"], registry=r).labels(
            pool=pool).set(1)

    def _register_per_model(self, r: CollectorRegistry, models: Sequence[ModelInfo]) -> None:
        """Per model version: a rollout compares versions by these. Only served versions become label values."""
        self.model_requests = Counter("inferlb_worker_model_requests",
                                      "Embedding requests by the model version they resolved to and HTTP status.",
                                      ["model", "code"], registry=r)
        self.model_request_duration = Histogram(
            "inferlb_worker_model_request_duration_seconds",
            "Time from request received to response ready, by the model version it resolved to.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        for model in models:
            self.model_request_duration.labels(model=model.name)

    def _register_cache(self, r: CollectorRegistry) -> None:
        """The per-input cache (workers/input_cache.py): what became of each input, and what the cache holds."""
        self.cache_requests = Counter("inferlb_worker_cache_requests",
                                      "Inputs by what the worker cache did with them: hit (answered from the cache), "
                                      "miss (queued for the model), coalesced (joined an identical input computing).",
                                      ["result"], registry=r)
        self._cache_results = {result: self.cache_requests.labels(result=result)
                               for result in ("hit", "miss", "coalesced")}
        self.cache_bytes_gauge = Gauge("inferlb_worker_cache_bytes", "Bytes the worker cache holds (vectors and "
                                       "their keys' token ids).", registry=r)
        self.cache_evictions = Counter("inferlb_worker_cache_evictions",
                                       "Entries evicted from the worker cache to stay within cache_max_bytes.",
                                       registry=r)

    def request_done(self, code: int, seconds: float, model: str | None = None) -> None:
        """Count a request; ``model``: the version it resolved to (None when it never got that far)."""
        self.requests.labels(code=str(code)).inc()
        self.request_duration.observe(seconds)
        if model is not None:
            self.model_requests.labels(model=model, code=str(code)).inc()
            self.model_request_duration.labels(model=model).observe(seconds)
        self._completed += 1

    # BatchObserver
    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None:
        self.compute.observe(seconds)
        self.batch_size.observe(size)
        self.batch_tokens.observe(tokens)
        self.batch_padded_tokens.observe(padded_tokens)
        self.tokens.inc(tokens)
        self.inputs.inc(size)

    def queue_wait(self, seconds: float, priority: Priority) -> None:
        self.queue_wait_seconds.observe(seconds)
        self._class_queue_wait[priority].observe(seconds)

    def queue_depth(self, items: int) -> None:
        self.queue_depth_gauge.set(items)

    def inputs_cancelled(self, items: int) -> None:
        self.cancelled_inputs.inc(items)

    def deadline_missed(self) -> None:
        self.deadline_misses.inc()

    # CacheCounter, CacheObserver
    def cache_results(self, *, hits: int, misses: int, coalesced: int) -> None:
        for result, count in (("hit", hits), ("miss", misses), ("coalesced", coalesced)):
            if count:
                self._cache_results[result].inc(count)

    def cache_bytes(self, size: int) -> None:
        self.cache_bytes_gauge.set(size)

    def cache_evicted(self, entries: int) -> None:
        self.cache_evictions.inc(entries)

    # periodic
    def sample_load(self, batch_cost: tuple[float, float]) -> None:
        self.load.sample(self._completed)
        self.cpu.set(self.load.cpu_utilization)
        self.rps_gauge.set(self.load.rps)
        self.batch_cost.labels(term="per_token").set(batch_cost[0])
        self.batch_cost.labels(term="fixed").set(batch_cost[1])

    def orca_header(self, *, queued: int, inflight: int) -> str:
        """ORCA load report in Envoy's TEXT format for ``endpoint-load-metrics``."""
        return (
            f"TEXT cpu_utilization={self.load.cpu_utilization:.4f}, rps_fractional={self.load.rps:.3f}, "
            f"named_metrics.queue={queued}, named_metrics.inflight={inflight}"
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
