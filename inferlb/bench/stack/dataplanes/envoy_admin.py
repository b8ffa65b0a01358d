"""Reading Envoy's admin API text: the counters of ``/stats`` and the per-host stats of ``/clusters``.

Pure functions of the text, so that the benches that poll Envoy (readiness, faults) read it one way and the
parsing is tested on sample text."""

from __future__ import annotations

from collections.abc import Iterator

from .envoy_static import WORKERS_CLUSTER


def parse_envoy_stats(stats_text: str) -> dict[str, int]:
    """The counters of Envoy's admin ``/stats`` text (name: value)."""
    counters = {}
    for line in stats_text.splitlines():
        key, _, value = line.partition(": ")
        if value.strip().isdigit():
            counters[key] = int(value)
    return counters


def envoy_stat(stats_text: str, name: str) -> int:
    """One counter of Envoy's admin ``/stats`` text (0 when absent)."""
    return parse_envoy_stats(stats_text).get(name, 0)


def envoy_stat_sum(stats_text: str, suffix: str) -> int:
    """The sum of the counters whose names end with ``suffix``, whatever their prefix (the listener's, ...)."""
    return sum(v for k, v in parse_envoy_stats(stats_text).items() if k.endswith(suffix))


def host_stats(clusters_text: str, stat: str, cluster: str = WORKERS_CLUSTER) -> Iterator[tuple[str, str]]:
    """``(host, value)`` of one per-host stat of ``cluster`` in ``/clusters`` text, in Envoy's order (its lines
    read ``cluster::host::stat::value``)."""
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == stat:
            yield parts[1], parts[3]


def healthy_hosts(clusters_text: str, cluster: str = WORKERS_CLUSTER) -> set[str]:
    """``host:port`` of the hosts Envoy's admin ``/clusters`` shows healthy in ``cluster``."""
    return {host for host, flags in host_stats(clusters_text, "health_flags", cluster) if flags == "healthy"}


def host_flags(clusters_text: str, host: str, cluster: str = WORKERS_CLUSTER) -> str | None:
    """Envoy's health flags of ``host`` in ``cluster`` ("healthy", "/failed_active_hc", ...); None: not there."""
    return next((flags for h, flags in host_stats(clusters_text, "health_flags", cluster) if h == host), None)


def host_weight(clusters_text: str, host: str, cluster: str = WORKERS_CLUSTER) -> int | None:
    """Envoy's load-balancing weight of ``host`` in ``cluster`` (from EDS); None: not there."""
    weight = next((w for h, w in host_stats(clusters_text, "weight", cluster) if h == host), None)
    return int(weight) if weight is not None and weight.isdigit() else None


def host_requests(clusters_text: str, cluster: str = WORKERS_CLUSTER) -> dict[str, int]:
    """Requests Envoy sent to each host of ``cluster`` (its ``rq_total``), retries included."""
    return {host: int(n) for host, n in host_stats(clusters_text, "rq_total", cluster) if n.isdigit()}
