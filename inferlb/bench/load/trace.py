"""The precomputed arrival schedule of one run: when each request is sent and how long it is.

Computed up front from (workload, rate, duration, seed) only, so that the live
bench (``inferlb bench``), every data-plane configuration it compares and the
fleet simulator (``inferlb sim``) replay the very same requests at the very
same offsets. Nothing here reads a clock or the network.

Arrivals:
- ``poisson``: exponential gaps with mean ``1 / rate``.
- ``bursty``: on/off periods (``burst_on_s``, ``burst_off_s``) starting with
  "on"; Poisson at ``rate * (on + off) / on`` while on, nothing while off, so
  the long-run mean rate is still ``rate``.

Lengths: a bucket is chosen by its share, then the token count (including
[CLS] and [SEP]) uniformly in ``[min_tokens, max_tokens]``.

Repeats (``workload.repeat_rate`` > 0): exactly ``round(repeat_rate * n)``
requests repeat an earlier request's text, each within its own length bucket:
the text of popularity rank ``k`` among that bucket's first fresh requests (its
share of ``repeat_pool``), ``k`` drawn Zipf(``repeat_zipf_s``) over the ranks
already sent. The repeats are spread over the buckets in proportion to their
requests, so the knob leaves the bucket sequence, and so the cost mix, as it
was: a 30% repeat rate is 30% of the requests and about 30% of the work. (Drawn
across buckets, a seed whose most popular text happened to be short repeated a
quarter of the work, and one whose head was long almost half.) A repeat takes
its source's length; ``repeat_of`` says which request that is (-1: fresh).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scenario import Workload

# A trace is held in memory; cap it so a typo in --rate/--duration fails fast, not by swapping.
MAX_EXPECTED_REQUESTS = 20_000_000


@dataclass(frozen=True, eq=False)
class Trace:
    """One run's requests, in send order.

    ``send_at_s``: float64 seconds from the start of the run, non-decreasing.
    ``tokens``: int64 token count of each request's input (incl. [CLS]/[SEP]).
    ``bucket``: int64 index into ``workload.mix`` each length was drawn from.
    ``repeat_of``: int64 index of the earlier fresh request whose text request ``i`` repeats, -1 for a
    fresh text (all -1 when not given).
    """

    send_at_s: np.ndarray
    tokens: np.ndarray
    bucket: np.ndarray
    rate_rps: float
    duration_s: float
    seed: int
    repeat_of: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.send_at_s.size)

    def __post_init__(self) -> None:
        if self.repeat_of is None:
            object.__setattr__(self, "repeat_of", np.full(self.send_at_s.size, -1, dtype=np.int64))
        for name in ("send_at_s", "tokens", "bucket", "repeat_of"):
            getattr(self, name).setflags(write=False)  # frozen all the way down: shared by B and C

    def window(self, start_s: float, end_s: float | None = None) -> np.ndarray:
        """Boolean mask of the requests scheduled in ``[start_s, end_s)`` (e.g. after the warm-up)."""
        end = self.duration_s if end_s is None else end_s
        return (self.send_at_s >= start_s) & (self.send_at_s < end)


def build_trace(workload: Workload, rate_rps: float, duration_s: float, seed: int) -> Trace:
    """The schedule of ``duration_s`` seconds of ``workload`` at a mean ``rate_rps`` requests/s.

    The same arguments always give the same trace (numpy's PCG64 seeded with
    ``seed``; arrivals, lengths and repeats use independent child streams, so
    changing the mix does not move the arrival times, and a trace without
    repeats is the same as before the knob existed). Raises ``ValueError``
    naming the bad argument.
    """
    if not np.isfinite(rate_rps) or rate_rps <= 0:
        raise ValueError(f"rate_rps must be a finite number > 0, got {rate_rps!r}")
    if not np.isfinite(duration_s) or duration_s <= 0:
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if rate_rps * duration_s > MAX_EXPECTED_REQUESTS:
        raise ValueError(f"rate_rps * duration_s = {rate_rps * duration_s:.0f} requests, over the limit of "
                         f"{MAX_EXPECTED_REQUESTS}")
    _check_mix(workload)
    # spawn(3)'s first two children are spawn(2)'s: adding the repeats' stream moved nothing
    arrivals_rng, lengths_rng, repeats_rng = (np.random.Generator(np.random.PCG64(s))
                                              for s in np.random.SeedSequence(int(seed)).spawn(3))
    if workload.arrival == "poisson":
        send_at = _poisson(arrivals_rng, rate_rps, duration_s)
    elif workload.arrival == "bursty":
        send_at = _bursty(arrivals_rng, rate_rps, duration_s, workload.burst_on_s, workload.burst_off_s)
    else:
        raise ValueError(f"workload.arrival must be 'poisson' or 'bursty', got {workload.arrival!r}")
    bucket, tokens = _lengths(lengths_rng, workload, send_at.size)
    repeat_of = _repeats(repeats_rng, workload, bucket)
    repeats = repeat_of >= 0
    tokens[repeats] = tokens[repeat_of[repeats]]
    return Trace(send_at, tokens, bucket, float(rate_rps), float(duration_s), int(seed), repeat_of)


def _check_mix(workload: Workload) -> None:
    mix = workload.mix
    if not mix:
        raise ValueError("workload.mix needs at least one bucket")
    for i, b in enumerate(mix):
        if not (b.share > 0 and 1 <= b.min_tokens <= b.max_tokens):
            raise ValueError(f"workload.mix[{i}] needs share > 0 and 1 <= min_tokens <= max_tokens, got {b}")
    total = sum(b.share for b in mix)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"workload.mix shares must add up to 1, got {total:g}")
    if not 0 <= workload.repeat_rate <= 1:
        raise ValueError(f"workload.repeat_rate must be in [0, 1], got {workload.repeat_rate!r}")
    if workload.repeat_pool < 1 or not workload.repeat_zipf_s > 0:
        raise ValueError(f"workload.repeat_pool must be >= 1 and repeat_zipf_s > 0, got {workload.repeat_pool!r} "
                         f"and {workload.repeat_zipf_s!r}")
    if workload.arrival == "bursty" and not (workload.burst_on_s > 0 and workload.burst_off_s >= 0):
        raise ValueError("bursty arrival needs burst_on_s > 0 and burst_off_s >= 0")


def _poisson(rng: np.random.Generator, rate: float, duration: float) -> np.ndarray:
    """Arrival times of a Poisson process on [0, duration): cumulative exponential gaps."""
    chunks: list[np.ndarray] = []
    t = 0.0
    expected = rate * duration
    while True:  # usually one draw; more only when the draw fell short of ``duration``
        n = int(expected + 6 * np.sqrt(expected) + 16)
        times = t + np.cumsum(rng.exponential(1.0 / rate, n))
        inside = times[times < duration]
        chunks.append(inside)
        if inside.size < n:
            return np.concatenate(chunks)
        t = float(times[-1])


def _bursty(rng: np.random.Generator, rate: float, duration: float, on_s: float, off_s: float) -> np.ndarray:
    """Poisson at ``rate * period / on`` in "on" time, mapped onto the wall clock around the off periods.

    Arrivals are drawn on the concatenated "on" time axis, then each on-time
    ``u`` becomes ``cycle * period + (u mod on)``: exactly a Poisson process
    restricted to the on-windows.
    """
    period = on_s + off_s
    on_rate = rate * period / on_s
    full_cycles, rest = divmod(duration, period)
    on_total = full_cycles * on_s + min(rest, on_s)
    u = _poisson(rng, on_rate, on_total)
    cycle, within = np.divmod(u, on_s)
    return np.sort(cycle * period + within)


def _lengths(rng: np.random.Generator, workload: Workload, n: int) -> tuple[np.ndarray, np.ndarray]:
    shares = np.array([b.share for b in workload.mix], dtype=np.float64)
    bucket = rng.choice(len(shares), size=n, p=shares / shares.sum()).astype(np.int64)
    lo = np.array([b.min_tokens for b in workload.mix], dtype=np.int64)[bucket]
    hi = np.array([b.max_tokens for b in workload.mix], dtype=np.int64)[bucket]
    tokens = rng.integers(lo, hi + 1, dtype=np.int64)  # inclusive of max_tokens
    return bucket, tokens


def _repeats(rng: np.random.Generator, workload: Workload, bucket: np.ndarray) -> np.ndarray:
    """Per request, the index of the fresh request it repeats, or -1 (see the module's docstring).

    The repeats' count is exact (``round(repeat_rate * n)``), so a bench's hit share does not wobble
    with the seed; it is shared out over the buckets by their request counts (largest remainder),
    and each bucket's repeats are chosen without replacement among its requests after its first.
    """
    n = bucket.size
    repeat_of = np.full(n, -1, dtype=np.int64)
    members = [np.flatnonzero(bucket == b) for b in range(len(workload.mix))]
    counts = _apportion(int(round(workload.repeat_rate * n)), [m.size - 1 if m.size else 0 for m in members])
    shares = np.array([b.share for b in workload.mix], dtype=np.float64)
    for b, (idx, count) in enumerate(zip(members, counts)):
        if count > 0:
            pool = max(1, int(round(workload.repeat_pool * shares[b] / shares.sum())))
            repeat_of[idx] = _repeats_within(rng, count, pool, workload.repeat_zipf_s, idx)
    return repeat_of


def _apportion(total: int, capacity: list[int]) -> list[int]:
    """``total`` split in proportion to ``capacity`` (largest remainder), none over its capacity."""
    room = sum(capacity)
    total = min(total, room)
    if total <= 0:
        return [0] * len(capacity)
    exact = [total * c / room for c in capacity]
    out = [int(e) for e in exact]
    for i in sorted(range(len(capacity)), key=lambda i: exact[i] - out[i], reverse=True)[:total - sum(out)]:
        out[i] += 1
    return out


def _repeats_within(rng: np.random.Generator, count: int, pool: int, zipf_s: float,
                    idx: np.ndarray) -> np.ndarray:
    """One bucket's ``repeat_of`` over its requests ``idx`` (trace indices, in send order).

    Rank ``k`` (0-based) is the bucket's ``k``-th fresh request; a repeat draws over the ranks sent
    before it only, by inverting the Zipf weights' cumulative sum truncated there.
    """
    m = idx.size
    out = np.full(m, -1, dtype=np.int64)
    chosen = np.sort(rng.choice(np.arange(1, m), size=count, replace=False))
    fresh = np.ones(m, dtype=bool)
    fresh[chosen] = False
    fresh_index = np.flatnonzero(fresh)
    available = np.minimum(np.cumsum(fresh)[chosen], pool)  # ranks sent before each repeat
    weights = np.cumsum(np.arange(1, pool + 1, dtype=np.float64) ** -zipf_s)
    rank = np.searchsorted(weights, rng.random(count) * weights[available - 1], side="right")
    out[chosen] = idx[fresh_index[np.minimum(rank, available - 1)]]
    return out
