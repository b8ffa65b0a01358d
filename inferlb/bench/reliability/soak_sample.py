"""One sample of the soak: each process's memory, descriptors and connections, each service's metric series,
and ext_proc's and the workers' in-flight accounting.

Why its own module: what is measured is kept apart from when (``soak_live.py``) and from the verdicts
(``soak_judge.py``). A sample is a flat mapping from a series name (``"rss:envoy"``, ``"series:ext_proc"``,
``"outstanding:requests"``) to a number, so every series is judged and stored the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping, Sequence

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from ..stack.fleet import INFLIGHT_METRIC

EXT_PROC_PREFIX = "inferlb_ext_proc_"
# ext_proc's accounting of work it sent and has not seen finish (ext_proc/metrics.py), summed over endpoints.
OUTSTANDING = {
    "outstanding:requests": "outstanding_requests",
    "outstanding:tokens": "outstanding_tokens",
    "outstanding:seconds": "outstanding_seconds",
    "outstanding:leaked": "outstanding_leaked",  # dropped by its age safety net: should stay 0
    "outstanding:streams": "active_streams",  # gRPC streams (HTTP requests) open
}
PROCESS_KINDS = ("rss", "fds", "connections")


@dataclass(frozen=True)
class Watched:
    """A process of the stack and where its metrics are (``is_worker``: its in-flight gauge is read too)."""

    name: str
    pid: int
    metrics_url: str
    is_worker: bool = False


def process_figures(pid: int) -> dict[str, float]:
    """RSS (bytes), open descriptors and inet sockets of ``pid`` and its descendants (none expected: summed
    so that a helper process could not hide a leak)."""
    root = psutil.Process(pid)
    rss = fds = connections = 0
    for proc in (root, *root.children(recursive=True)):
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            connections += len(proc.net_connections(kind="inet"))
        except psutil.NoSuchProcess:
            if proc is root:
                raise
    return {"rss": float(rss), "fds": float(fds), "connections": float(connections)}


def series_count(text: str) -> int:
    """The samples in a Prometheus text exposition: every labelled series, histogram buckets included."""
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def gauge_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` summed over its labels (0 when absent: ext_proc drops an endpoint's series at 0)."""
    wanted = set(names)
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                sums[s.name] += s.value
    return sums


def read_metrics(text: str, watched: Watched) -> dict[str, float]:
    """What one service's /metrics contributes to a sample (parsing is CPU work: run it in a thread)."""
    out = {f"series:{watched.name}": float(series_count(text))}
    if watched.name == "ext_proc":
        sums = gauge_sums(text, [EXT_PROC_PREFIX + g for g in OUTSTANDING.values()])
        out.update({key: sums[EXT_PROC_PREFIX + g] for key, g in OUTSTANDING.items()})
    if watched.is_worker:
        out[f"inflight:{watched.name}"] = gauge_sums(text, [INFLIGHT_METRIC])[INFLIGHT_METRIC]
    return out


async def take_sample(client: httpx.AsyncClient, watched: Sequence[Watched]) -> dict[str, float]:
    """Every figure of every watched process, now. A process that is gone or a scrape that fails raises:
    the soak stops (a dead component is a finding, not a gap in the data)."""
    texts = await asyncio.gather(*(client.get(w.metrics_url) for w in watched))
    sample: dict[str, float] = {}
    for w, response in zip(watched, texts):
        response.raise_for_status()
        figures = await asyncio.to_thread(process_figures, w.pid)
        sample.update({f"{kind}:{w.name}": value for kind, value in figures.items()})
        sample.update(await asyncio.to_thread(read_metrics, response.text, w))
    return sample


def settled(sample: Mapping[str, float]) -> bool:
    """Nothing in flight anywhere: ext_proc's outstanding work and open streams, every worker's requests."""
    keys = [k for k in sample if k.startswith(("outstanding:", "inflight:")) and k != "outstanding:leaked"]
    return bool(keys) and all(abs(sample[k]) < 1e-9 for k in keys)
