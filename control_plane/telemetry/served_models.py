"""What a worker serves, from its ``/metrics``: model versions, the aliases they answer to, its pool.

Workers say it in two info metrics (``inferlb_runtime.model_routing``)::

    inferlb_worker_model_info{model="m-int8",family="m",aliases="a,b"} 1
    inferlb_worker_pool_info{pool="default"} 1

The scraper reads them with every scrape and the controller keeps the last
answer on the ``Endpoint`` (through failed scrapes too), so the rich EDS can
tell ext_proc which endpoints serve which model. A name that breaks the
contract's patterns is left out and reported (never a failed scrape, never a
crash): one bad label must not take a worker out of the fleet, and it must
not reach ext_proc, a metric label or a header either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from inferlb_runtime.model_routing import DEFAULT_POOL, POOL_PATTERN, check_model_name

MODEL_INFO = "inferlb_worker_model_info"  # {model, family, aliases="a,b"} 1
POOL_INFO = "inferlb_worker_pool_info"  # {pool} 1
# What one worker may declare: its catalogue rides in every ext_proc EDS push, so a worker (untrusted
# input) claiming thousands of names must not bloat it. Beyond these, names are left out and reported.
MAX_MODELS = 64
MAX_ALIASES = 256


@dataclass(frozen=True)
class ServedModels:
    """One worker's catalogue: versions and aliases sorted (deterministic EDS bytes), its pool."""

    models: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # every alias and family of every version, without the version ids
    pool: str = DEFAULT_POOL


@dataclass(frozen=True)
class ServedModelsReading:
    """What was read, and why any part of it was left out (for a log line)."""

    served: ServedModels
    problems: tuple[str, ...] = ()


def _info_labels(families: Mapping[str, Metric], name: str) -> list[dict[str, str]]:
    """The labels of every ``name`` sample with a positive finite value (an info metric says 1)."""
    family = families.get(name)
    if family is None:
        return []
    return [s.labels for s in family.samples
            if s.name == name and math.isfinite(float(s.value)) and float(s.value) > 0]


def _valid(name: str, what: str, problems: list[str]) -> bool:
    try:
        check_model_name(name, what)
    except ValueError as exc:
        problems.append(str(exc))
        return False
    return True


def read_served_models(families: Mapping[str, Metric]) -> ServedModelsReading:
    """The catalogue in parsed ``/metrics`` families (``telemetry.parse_families``).

    No model info: no versions (a worker from before issue 15 declares none). No pool info: the
    default pool. Several valid pools: the first in sort order, reported.
    """
    problems: list[str] = []
    models: set[str] = set()
    aliases: set[str] = set()
    for labels in _info_labels(families, MODEL_INFO):
        model = labels.get("model", "")
        if not _valid(model, "model", problems):
            continue
        models.add(model)
        names = [labels["family"]] if labels.get("family") else []
        names += [a.strip() for a in labels.get("aliases", "").split(",") if a.strip()]
        aliases.update(a for a in names if _valid(a, f"alias of {model!r}", problems))
    pools = set()
    for labels in _info_labels(families, POOL_INFO):
        pool = labels.get("pool", "")
        if POOL_PATTERN.match(pool):
            pools.add(pool)
        else:
            problems.append(f"pool {pool!r} must be a Kubernetes name: lower case letters, digits and '-', "
                            "at most 63 characters")
    if len(pools) > 1:
        problems.append(f"several pools {sorted(pools)}: taking {min(pools)!r}")
    if len(models) > MAX_MODELS:
        problems.append(f"{len(models)} models: keeping the first {MAX_MODELS} in sort order")
        models = set(sorted(models)[:MAX_MODELS])
    aliases -= models
    if len(aliases) > MAX_ALIASES:
        problems.append(f"{len(aliases)} aliases: keeping the first {MAX_ALIASES} in sort order")
        aliases = set(sorted(aliases)[:MAX_ALIASES])
    served = ServedModels(tuple(sorted(models)), tuple(sorted(aliases)),
                          min(pools) if pools else DEFAULT_POOL)
    return ServedModelsReading(served, tuple(problems))
