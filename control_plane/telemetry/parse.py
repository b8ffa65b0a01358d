"""From a worker's Prometheus text to windowed, smoothed ``Telemetry``: pure functions only.

Three steps, each testable alone:

1. ``parse_sample``: one scrape -> the raw cumulative values (``Sample``).
2. ``window``: two consecutive samples -> what happened between them
   (``WindowFigures``: rates, latency percentiles, error rate ...), the way
   Prometheus' ``rate()`` and ``histogram_quantile()`` would compute them.
3. ``smooth``: EWMA of the window figures into ``model.Telemetry``.

The control plane never imports ``workers``: the metric names below are the
wire contract documented in docs/operators.md ("The worker"), read from the text
exposition only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..model import Telemetry

PREFIX = "inferlb_worker_"
REQUESTS = PREFIX + "requests"  # counter{code}; the parser drops the ``_total`` suffix
DURATION = PREFIX + "request_duration_seconds"
QUEUE_WAIT = PREFIX + "queue_wait_seconds"
TOKENS = PREFIX + "tokens"
INPUTS = PREFIX + "inputs"
QUEUE_DEPTH = PREFIX + "queue_depth"
INFLIGHT = PREFIX + "inflight_requests"
CPU = PREFIX + "cpu_utilization"
BATCH_COST = PREFIX + "batch_cost_seconds"  # optional: gauge{term="per_token"|"fixed"}
SLOTS = PREFIX + "slots"  # optional: jobs run at once; a worker that does not say has one
START_TIME = "process_start_time_seconds"  # optional: detects restarts even if counters grew back

REQUIRED_FAMILIES = (REQUESTS, DURATION, QUEUE_WAIT, TOKENS, INPUTS, QUEUE_DEPTH, INFLIGHT, CPU)


@dataclass(frozen=True)
class HistogramSample:
    """One cumulative histogram: ``buckets`` are (upper bound, cumulative count), ascending, ending at +Inf."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def bounds(self) -> tuple[float, ...]:
        return tuple(b for b, _ in self.buckets)


EMPTY_HISTOGRAM = HistogramSample(buckets=((math.inf, 0.0),), sum=0.0, count=0.0)


@dataclass(frozen=True)
class Sample:
    """The raw values of one scrape, taken at ``at`` (``time.monotonic()``).

    Counters are cumulative since the worker started; gauges are instantaneous.
    Requests are split into disjoint classes: ``requests_4xx`` excludes 429,
    which counts as the worker's own overload (like a 5xx) rather than a
    client mistake.
    """

    at: float
    requests_total: float
    requests_2xx: float
    requests_4xx: float
    requests_429: float
    requests_5xx: float
    duration: HistogramSample
    queue_wait_sum: float
    queue_wait_count: float
    tokens_total: float
    inputs_total: float
    queue_depth: float
    inflight: float
    cpu_utilization: float
    batch_cost_per_token_s: float = 0.0
    batch_cost_fixed_s: float = 0.0
    slots: float = 1.0
    process_start_time: float | None = None
    # Sample lines of the families read here whose value was NaN or +-Inf: skipped, not summed. A sample
    # with any is not windowed (the scraper keeps the last clean one), so no EWMA ever sees them.
    refused: int = 0


@dataclass(frozen=True)
class WindowFigures:
    """What one worker did between two scrapes.

    ``None`` means "no data in this window" (e.g. no requests, so no latency),
    which is not the same as zero and must not be smoothed in as zero.
    """

    interval_s: float
    requests: float
    rps: float
    tokens_per_s: float
    inputs_per_s: float
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    latency_per_token_s: float | None
    queue_wait_mean_s: float | None
    error_rate: float | None
    queue_depth: float
    inflight: float
    cpu_utilization: float
    batch_cost_per_token_s: float
    batch_cost_fixed_s: float
    slots: float = 1.0
    restarted: bool = False


# -- 1. parse -----------------------------------------------------------------


def parse_families(text: str) -> dict[str, Metric]:
    """A ``/metrics`` body's families by name; ``ValueError`` if it is not the Prometheus text format."""
    try:
        return {family.name: family for family in text_string_to_metric_families(text)}
    except Exception as exc:  # the parser raises several types on garbage; all mean the same here
        raise ValueError(f"not a Prometheus text exposition: {exc}") from None


def _refused(families: Mapping[str, Metric]) -> int:
    """How many sample lines of the families read here carry a NaN or infinite value (any metric type).

    A bucket's ``le="+Inf"`` is a label, not a value: only values are checked.
    """
    names = (*REQUIRED_FAMILIES, BATCH_COST, SLOTS, START_TIME)
    return sum(1 for name in names if name in families
               for s in families[name].samples if not math.isfinite(float(s.value)))


def _samples(families: Mapping[str, Metric], family: str, sample: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of every finite ``sample`` line in ``family``; none if the family is absent."""
    found = families.get(family)
    if found is None:
        return []
    return [(s.labels, float(s.value)) for s in found.samples if s.name == sample and math.isfinite(float(s.value))]


def _scalar(families: Mapping[str, Metric], family: str, sample: str, default: float = 0.0) -> float:
    """The first finite value of ``sample``; ``default`` if there is none."""
    found = _samples(families, family, sample)
    return found[0][1] if found else default


def _histogram(families: Mapping[str, Metric], name: str) -> HistogramSample:
    kind = families[name].type
    if kind != "histogram":
        raise ValueError(f"{name} should be a histogram, is a {kind}")
    raw = [(s.labels, float(s.value)) for s in families[name].samples if s.name == name + "_bucket"]
    if any("le" not in labels for labels, _ in raw):
        raise ValueError(f"histogram {name} has a bucket without 'le'")
    if raw and not any(math.isinf(float(labels["le"])) for labels, _ in raw):
        raise ValueError(f"histogram {name} has no +Inf bucket")
    # The +Inf in le="+Inf" is a bound; a bucket whose count is not finite is refused (see ``_refused``).
    buckets = sorted((float(labels["le"]), value) for labels, value in raw if math.isfinite(value))
    if not buckets:  # a labelled histogram with no children yet (or only refused counts)
        return EMPTY_HISTOGRAM
    return HistogramSample(
        buckets=tuple(buckets),
        sum=_scalar(families, name, name + "_sum"),
        count=_scalar(families, name, name + "_count", buckets[-1][1]),
    )


def parse_sample(text: str, at: float) -> Sample:
    """Parse one ``/metrics`` body of an inferlb worker (see :func:`sample_from_families`)."""
    return sample_from_families(parse_families(text), at)


def sample_from_families(families: Mapping[str, Metric], at: float) -> Sample:
    """The telemetry sample in one inferlb worker's parsed ``/metrics``.

    Raises ``ValueError`` naming the missing metrics if the text is not an
    inferlb worker's (another service on that port, a proxy's error page), so
    the scraper reports the target instead of crashing or inventing zeros.
    NaN and infinite values are skipped line by line and counted in ``refused``.
    """
    missing = [name for name in REQUIRED_FAMILIES if name not in families]
    if missing:
        raise ValueError(f"not an inferlb worker's /metrics: missing {', '.join(missing)}")

    by_class = {"2xx": 0.0, "4xx": 0.0, "429": 0.0, "5xx": 0.0}
    total = 0.0
    for labels, value in _samples(families, REQUESTS, REQUESTS + "_total"):
        total += value
        code = labels.get("code", "")
        cls = "429" if code == "429" else f"{code[:1]}xx"
        if cls in by_class:
            by_class[cls] += value

    cost = {labels.get("term"): value for labels, value in _samples(families, BATCH_COST, BATCH_COST)}
    queue_wait = _histogram(families, QUEUE_WAIT)
    start = _scalar(families, START_TIME, START_TIME, math.nan)
    return Sample(
        at=at,
        requests_total=total,
        requests_2xx=by_class["2xx"],
        requests_4xx=by_class["4xx"],
        requests_429=by_class["429"],
        requests_5xx=by_class["5xx"],
        duration=_histogram(families, DURATION),
        queue_wait_sum=queue_wait.sum,
        queue_wait_count=queue_wait.count,
        tokens_total=_scalar(families, TOKENS, TOKENS + "_total"),
        inputs_total=_scalar(families, INPUTS, INPUTS + "_total"),
        queue_depth=_scalar(families, QUEUE_DEPTH, QUEUE_DEPTH),
        inflight=_scalar(families, INFLIGHT, INFLIGHT),
        cpu_utilization=_scalar(families, CPU, CPU),
        batch_cost_per_token_s=cost.get("per_token", 0.0),
        batch_cost_fixed_s=cost.get("fixed", 0.0),
        slots=max(1.0, _scalar(families, SLOTS, SLOTS, 1.0)),
        process_start_time=None if math.isnan(start) else start,
        refused=_refused(families),
    )


# -- 2. window ----------------------------------------------------------------


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative (upper bound, count) buckets.

    Linear interpolation inside the bucket holding the rank; the first bucket
    starts at 0; a rank in the +Inf bucket returns the highest finite bound.
    ``None`` when the histogram is empty.
    """
    buckets = list(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound if len(buckets) > 1 else None
            if upper <= 0 or count == lower_count:
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper, count
    return lower_bound


def _counters(s: Sample) -> tuple[float, ...]:
    return (
        s.requests_total, s.requests_2xx, s.requests_4xx, s.requests_429, s.requests_5xx,
        s.duration.sum, s.duration.count, *(c for _, c in s.duration.buckets),
        s.queue_wait_sum, s.queue_wait_count, s.tokens_total, s.inputs_total,
    )


def restarted(prev: Sample, cur: Sample) -> bool:
    """The worker restarted between the samples: a new start time, or any counter went down."""
    if prev.process_start_time is not None and cur.process_start_time is not None:
        if cur.process_start_time != prev.process_start_time:
            return True
    if prev.duration.bounds() != cur.duration.bounds():
        return True  # a different histogram layout is a different process
    return any(c < p for p, c in zip(_counters(prev), _counters(cur)))


def _zero(like: Sample) -> Sample:
    """The counters of a process that just started: what ``rate()`` assumes after a reset."""
    zero_hist = HistogramSample(tuple((b, 0.0) for b in like.duration.bounds()), 0.0, 0.0)
    return Sample(
        at=like.at, requests_total=0.0, requests_2xx=0.0, requests_4xx=0.0, requests_429=0.0, requests_5xx=0.0,
        duration=zero_hist, queue_wait_sum=0.0, queue_wait_count=0.0, tokens_total=0.0, inputs_total=0.0,
        queue_depth=0.0, inflight=0.0, cpu_utilization=0.0,
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def window(prev: Sample, cur: Sample) -> WindowFigures:
    """The figures of the interval between two scrapes of one worker.

    A counter reset (the worker restarted) counts ``cur`` from zero, as
    Prometheus' ``rate()`` does: the requests before the restart are lost,
    never counted as negative.
    """
    interval = cur.at - prev.at
    if interval <= 0:
        raise ValueError(f"samples out of order: {prev.at} then {cur.at}")
    reset = restarted(prev, cur)
    base = _zero(cur) if reset else prev

    requests = cur.requests_total - base.requests_total
    tokens = cur.tokens_total - base.tokens_total
    duration_sum = cur.duration.sum - base.duration.sum
    duration_count = cur.duration.count - base.duration.count
    bucket_deltas = [(b, c - p) for (b, c), (_, p) in zip(cur.duration.buckets, base.duration.buckets)]
    errors = (cur.requests_5xx - base.requests_5xx) + (cur.requests_429 - base.requests_429)
    return WindowFigures(
        interval_s=interval,
        requests=requests,
        rps=requests / interval,
        tokens_per_s=tokens / interval,
        inputs_per_s=(cur.inputs_total - base.inputs_total) / interval,
        latency_mean_s=_ratio(duration_sum, duration_count),
        latency_p50_s=histogram_quantile(0.5, bucket_deltas),
        latency_p99_s=histogram_quantile(0.99, bucket_deltas),
        latency_per_token_s=_ratio(duration_sum, tokens) if duration_count > 0 else None,
        queue_wait_mean_s=_ratio(cur.queue_wait_sum - base.queue_wait_sum, cur.queue_wait_count - base.queue_wait_count),
        error_rate=_ratio(errors, requests),
        queue_depth=cur.queue_depth,
        inflight=cur.inflight,
        cpu_utilization=cur.cpu_utilization,
        batch_cost_per_token_s=cur.batch_cost_per_token_s,
        batch_cost_fixed_s=cur.batch_cost_fixed_s,
        slots=cur.slots,
        restarted=reset,
    )


# -- 3. smooth ----------------------------------------------------------------

# Figures that exist only when the window had requests: an idle window keeps the old value.
_LATENCY_FIELDS = (
    "latency_mean_s", "latency_p50_s", "latency_p99_s", "latency_per_token_s", "queue_wait_mean_s", "error_rate",
)
# Rates: always measured, an idle window really is zero.
_RATE_FIELDS = ("rps", "tokens_per_s", "cpu_utilization")
# Taken as reported: the worker's own least-squares fit (already smoothed there), its slot count (a fact,
# not a measurement), and the queue and in-flight gauges. ext_proc counts other routers' work from the
# gauges; an EWMA of them lags the truth by seconds, so replicas would herd onto workers that only look idle.
_LATEST_FIELDS = ("batch_cost_per_token_s", "batch_cost_fixed_s", "slots", "queue_depth", "inflight")


def smooth(prev: Telemetry | None, figures: WindowFigures, at: float, alpha: float) -> Telemetry:
    """EWMA of one window into the previous telemetry: ``new = alpha * x + (1 - alpha) * old``.

    A window without requests keeps the previous latency and error figures (no
    data is not zero latency) and still updates rates and gauges. A latency of
    exactly 0.0 in ``prev`` means "never measured" (``Telemetry``'s default),
    so the first real measurement is taken as is instead of being averaged
    with that zero. A figure that is not finite is ignored like a missing one,
    so one bad window can never poison the average for good.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    values: dict[str, float] = {}
    for name in _LATENCY_FIELDS:
        x: float | None = _finite(getattr(figures, name))
        old = getattr(prev, name) if prev is not None else None
        if x is None:
            values[name] = old if old is not None else 0.0
        elif old is None or (old == 0.0 and name != "error_rate"):
            values[name] = x
        else:
            values[name] = alpha * x + (1.0 - alpha) * old
    for name in (*_RATE_FIELDS, *_LATEST_FIELDS):
        x = _finite(getattr(figures, name))
        old = getattr(prev, name) if prev is not None else None
        if x is None:  # overflowed (a counter near 1e308 over a short window): keep what was known
            values[name] = old if old is not None else 0.0
        elif name in _LATEST_FIELDS or old is None:
            values[name] = x
        else:
            values[name] = alpha * x + (1.0 - alpha) * old
    return Telemetry(observed_at=at, **values)


def _finite(x: float | None) -> float | None:
    """``x``, or None when it is not a finite number: no NaN or infinity may enter an average."""
    return x if x is not None and math.isfinite(x) else None


def is_stale(t: Telemetry | None, now: float, max_age_s: float) -> bool:
    """True when there is no telemetry or it is older than ``max_age_s``: not to be used as fresh."""
    return t is None or now - t.observed_at > max_age_s
