"""inferlb bench quota-accuracy: issue 14's accuracy target, through real processes.

Target: two ext_proc replicas share one Redis; ten clients of one tenant
send 3x its tokens per minute; admitted tokens stay within 2% of the quota
per window. The bench runs exactly that: a throwaway redis-server (or
--redis-url), a real control plane that issues the tenant's API key, and
real ext_proc replicas (``python -m ext_proc``, keys required, the quota
store in Redis). The clients play Envoy's ext_proc messages over gRPC,
five per replica, each on an open-loop Poisson schedule of real embeddings
bodies of 1 to 64 sentences (token counts exact by construction).

Per window of the quota algorithm (Redis TIME // 60 s) it counts the tokens
offered and those ext_proc admitted (its own count, x-inferlb-tokens, of
every request it let through; a 429 is refused), prints a line as each
window ends, then the table and the verdict: every full window within 2% of
the quota (the partial first and last windows are shown, not judged; no
window may ever exceed the quota). Both replicas' /metrics (quota decisions,
tokens served) are read as a cross-check.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..processes import ProcessGroup
from .quota_accuracy_load import MAX_REQUESTS, WINDOW_MS, LoadRun, RedisClock, Sent, drive, plan_load, requests_per_s
from .quota_bench import throwaway_redis
from ..load.texts import MAX_TOKENS, SPECIAL_TOKENS

DESCRIPTION = __doc__.split("\n\n", 1)[1] if __doc__ else ""
Log = Callable[[str], None]
ROOM_MARGIN_S = 5.0  # --fit-window: room left in the window beyond the run's length (late requests)


@dataclass(frozen=True)
class Settings:
    tokens_per_minute: int = 100_000
    load: float = 3.0  # offered tokens per minute, in quotas
    seconds: float = 180.0
    clients: int = 10
    replicas: int = 2
    sentences: tuple[int, int] = (1, 64)
    sentence_tokens: tuple[int, int] = (8, 24)
    tolerance: float = 0.02
    seed: int = 1
    redis_url: str | None = None
    fit_window: bool = False  # start when the whole run fits in one window (waiting for the next if needed)


@dataclass(frozen=True)
class WindowRow:
    window: int  # Redis TIME // 60 s
    start: str  # UTC
    full: bool  # the load covered all of it: judged
    offered_requests: int
    offered_tokens: int
    admitted_requests: int
    admitted_tokens: int
    refused_requests: int
    admitted_per_quota: float


@dataclass(frozen=True)
class Result:
    settings: Settings
    tenant: str
    windows: list[WindowRow]
    verdict: str  # met, MISSED, or why nothing was judged
    over_quota_windows: list[int]  # windows (any) whose admitted tokens exceed the quota: never allowed
    outcomes: dict[str, int]  # admitted, rate_limited, and anything else ext_proc or gRPC answered
    planned: int
    not_sent: int
    dropped: int
    max_lag_s: float
    largest_request_tokens: int
    count_mismatches: int  # admitted requests whose x-inferlb-tokens differs from the body's exact count
    without_reset_header: int  # admitted requests whose window came from the clock alone
    replicas: list[dict[str, Any]] = field(default_factory=list)  # each replica's /metrics figures


def tally(load: LoadRun, quota: int, tolerance: float) -> tuple[list[WindowRow], str, list[int]]:
    """The table (every window the load touched), the verdict over the full windows, and any window over the
    quota. Offered tokens go to the window a request was sent in; admitted ones to the window ext_proc's
    quota check ran in."""
    offered: Counter[int] = Counter()
    offered_n: Counter[int] = Counter()
    admitted: Counter[int] = Counter()
    admitted_n: Counter[int] = Counter()
    refused_n: Counter[int] = Counter()
    for s in load.sent:
        sent_in = int(s.sent_ms // WINDOW_MS)
        offered[sent_in] += s.tokens
        offered_n[sent_in] += 1
        if s.outcome == "admitted":
            decided_in = s.decision_window
            admitted[decided_in] += s.counted if s.counted is not None else s.tokens
            admitted_n[decided_in] += 1
        elif s.outcome == "rate_limited":
            refused_n[s.decision_window] += 1
    windows = sorted(set(offered) | set(admitted))
    rows = [WindowRow(w, _utc(w), w * WINDOW_MS >= load.start_ms and (w + 1) * WINDOW_MS <= load.end_ms,
                      offered_n[w], offered[w], admitted_n[w], admitted[w], refused_n[w], admitted[w] / quota)
            for w in windows]
    judged = [r for r in rows if r.full]
    over = [r.window for r in rows if r.admitted_tokens > quota]
    if not judged:
        verdict = "not judged: no full window (run for at least 2 minutes)"
    elif all(abs(r.admitted_per_quota - 1) <= tolerance for r in judged) and not over:
        verdict = "met"
    else:
        verdict = "MISSED"
    return rows, verdict, over


def _utc(window: int) -> str:
    return datetime.datetime.fromtimestamp(window * WINDOW_MS / 1000, datetime.timezone.utc).strftime("%H:%M:%S")


def progress_line(quota: int) -> Callable[[list[Sent], int], str]:
    """The line printed as a window ends (requests still open then are in the final table only)."""
    def line(sent: list[Sent], window: int) -> str:
        offered = sum(s.tokens for s in sent if int(s.sent_ms // WINDOW_MS) == window)
        admitted = sum(s.counted or s.tokens for s in sent if s.outcome == "admitted" and s.decision_window == window)
        return (f"[window {_utc(window)} UTC] offered {offered} tokens, admitted {admitted} "
                f"({admitted / quota:.2%} of the quota)")
    return line


async def replica_figures(client: httpx.AsyncClient, metrics_url: str, tenant: str) -> dict[str, Any]:
    """One replica's own count: quota decisions by result, the tenant's tokens by outcome, store errors and
    round trips."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get(f"{metrics_url}/metrics")
    response.raise_for_status()
    figures: dict[str, Any] = {"metrics_url": metrics_url, "quota_decisions": {}, "tenant_tokens": {},
                               "tenant_requests": {}, "quota_store_errors": 0.0}
    round_trips = [0.0, 0.0]
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            if s.name == "inferlb_ext_proc_quota_decisions_total":
                figures["quota_decisions"][s.labels["result"]] = int(s.value)
            elif s.name in ("inferlb_ext_proc_tenant_tokens_total", "inferlb_ext_proc_tenant_requests_total") \
                    and s.labels.get("tenant") == tenant:
                figures[s.name.removeprefix("inferlb_ext_proc_").removesuffix("_total")][s.labels["outcome"]] = \
                    int(s.value)
            elif s.name == "inferlb_ext_proc_quota_store_errors_total":
                figures["quota_store_errors"] += s.value
            elif s.name == "inferlb_ext_proc_quota_store_seconds_sum":
                round_trips[0] = s.value
            elif s.name == "inferlb_ext_proc_quota_store_seconds_count":
                round_trips[1] = s.value
    figures["quota_store_round_trips"] = int(round_trips[1])
    figures["quota_store_mean_ms"] = round_trips[0] / round_trips[1] * 1000 if round_trips[1] else None
    return figures


async def run(settings: Settings, log: Log, work_dir: Path) -> Result:
    """Start everything, offer the load, stop everything; the figures."""
    import redis.asyncio as aioredis

    from .quota_accuracy_stack import start_quota_stack

    schedules = plan_load(settings.tokens_per_minute, settings.load, settings.seconds, settings.clients,
                          settings.sentences, settings.sentence_tokens, settings.seed)
    tenant = f"bench-accuracy-{secrets.token_hex(4)}"  # a fresh quota, even on a --redis-url in use
    async with throwaway_redis(settings.redis_url) as redis_url, ProcessGroup() as group, \
            httpx.AsyncClient(timeout=10, trust_env=False) as client:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            clock = await RedisClock.read(redis)
        finally:
            await redis.aclose()
        stack = await start_quota_stack(group, client, work_dir, redis_url, tenant, settings.tokens_per_minute,
                                        settings.replicas, clock, log)
        if settings.fit_window:
            await _fit_in_window(clock, settings.seconds + ROOM_MARGIN_S, log)
        planned = sum(map(len, schedules))
        log(f"[load] {settings.clients} clients, {planned} requests over {settings.seconds:g} s, offering "
            f"{settings.load:g} x {settings.tokens_per_minute} tokens per minute")
        line = progress_line(settings.tokens_per_minute)
        load = await drive(stack.targets, stack.key, schedules, settings.seconds, clock, stack.pick_header,
                           lambda sent, window: log(line(sent, window)))
        group.check_alive()
        replicas = [await replica_figures(client, url, tenant) for url in stack.metrics_urls]
    rows, verdict, over = tally(load, settings.tokens_per_minute, settings.tolerance)
    admitted = [s for s in load.sent if s.outcome == "admitted"]
    return Result(settings, tenant, rows, verdict, over, dict(Counter(s.outcome for s in load.sent)), load.planned,
                  load.not_sent, load.dropped, load.max_lag_s,
                  max((p.tokens for schedule in schedules for p in schedule), default=0),
                  sum(1 for s in admitted if s.counted != s.tokens), sum(1 for s in admitted if s.reset_ms is None),
                  replicas)


async def _fit_in_window(clock: RedisClock, need_s: float, log: Log) -> None:
    """Return once at least ``need_s`` are left in Redis's current window (waiting for the next if not)."""
    left_ms = WINDOW_MS - clock.now_ms() % WINDOW_MS
    if left_ms >= need_s * 1000:
        return
    log(f"[load] {left_ms / 1000:.1f} s left in this window, {need_s:g} s needed: starting with the next one")
    await asyncio.sleep(left_ms / 1000 + 0.05)


def render(result: Result) -> str:
    """The table, the verdict and the cross-check."""
    q = result.settings.tokens_per_minute
    lines = [f"tenant {result.tenant}: quota {q} tokens per minute, {result.settings.load:g}x offered by "
             f"{result.settings.clients} clients on {result.settings.replicas} ext_proc replicas sharing one Redis",
             "", "| window (UTC) | offered requests | offered tokens | admitted requests | admitted tokens | "
             "refused (429) | admitted / quota |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result.windows:
        judged = "" if r.full else " (partial, not judged)"
        lines.append(f"| {r.start}{judged} | {r.offered_requests} | {r.offered_tokens} | {r.admitted_requests} | "
                     f"{r.admitted_tokens} | {r.refused_requests} | {r.admitted_per_quota:.2%} |")
    tol = result.settings.tolerance
    lines.append(f"\nadmitted tokens within {tol:.0%} of the quota in every full window: {result.verdict}")
    lines.append("windows over the quota: " + (", ".join(map(_utc, result.over_quota_windows)) or "none"))
    lines.append(f"outcomes: {dict(sorted(result.outcomes.items()))}; not sent (schedule > 30 s behind): "
                 f"{result.not_sent}; dropped (client full): {result.dropped}; latest send {result.max_lag_s:.3f} s "
                 f"behind schedule; largest request {result.largest_request_tokens} tokens")
    lines.append(f"ext_proc's count vs the bodies' exact tokens: {result.count_mismatches} mismatches; admitted "
                 f"without a reset header (window from the clock): {result.without_reset_header}")
    for i, fig in enumerate(result.replicas):
        served = fig["tenant_tokens"].get("served", 0)
        lines.append(f"replica {i} /metrics: quota decisions {fig['quota_decisions']}, tenant tokens served {served}, "
                     f"store errors {fig['quota_store_errors']:g}, {fig['quota_store_round_trips']} Redis round "
                     f"trips" + (f" (mean {fig['quota_store_mean_ms']:.2f} ms)" if fig["quota_store_mean_ms"] else ""))
    admitted = sum(r.admitted_tokens for r in result.windows)
    served = sum(f["tenant_tokens"].get("served", 0) for f in result.replicas)
    lines.append(f"cross-check: tokens admitted as the clients saw them {admitted}, served as the replicas counted "
                 f"them {served}: {'agree' if admitted == served else 'DISAGREE'}")
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--minutes", type=float, default=d.seconds / 60,
                        help=f"how long the load runs ({d.seconds / 60:g}; windows are judged only when whole)")
    parser.add_argument("--quota", type=int, default=d.tokens_per_minute,
                        help=f"the tenant's tokens per minute ({d.tokens_per_minute})")
    parser.add_argument("--load", type=float, default=d.load,
                        help=f"tokens offered per minute, in quotas ({d.load:g})")
    parser.add_argument("--clients", type=int, default=d.clients,
                        help=f"clients, spread over the replicas ({d.clients})")
    parser.add_argument("--replicas", type=int, default=d.replicas, help=f"ext_proc replicas ({d.replicas})")
    parser.add_argument("--sentences", type=_range, default=d.sentences, metavar="LOW-HIGH",
                        help="texts per request, drawn uniformly (1-64)")
    parser.add_argument("--sentence-tokens", type=_range, default=d.sentence_tokens, metavar="LOW-HIGH",
                        help="tokens per text, [CLS] and [SEP] included, drawn uniformly (8-24)")
    parser.add_argument("--tolerance", type=float, default=d.tolerance,
                        help=f"how far from the quota a full window may be ({d.tolerance:g})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"the schedules' and sizes' seed ({d.seed})")
    parser.add_argument("--redis-url", help="use this Redis (default: start a throwaway redis-server)")
    parser.add_argument("--fit-window", action="store_true",
                        help="start the load when it fits in what is left of Redis's current window (waiting "
                             "for the next one otherwise): a short run then measures one window")
    parser.add_argument("--work-dir", type=Path, help="keep the processes' logs here (default: a temporary "
                        "directory, removed)")
    parser.add_argument("--json", type=Path, help="also write the results here")


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings, or SystemExit saying which argument is wrong."""
    problems = [what for bad, what in (
        (args.minutes <= 0, "--minutes must be > 0"), (args.quota < 1, "--quota must be >= 1"),
        (args.load <= 0, "--load must be > 0"), (args.clients < 1, "--clients must be >= 1"),
        (args.replicas < 1, "--replicas must be >= 1"), (not 0 < args.tolerance < 1, "--tolerance must be in (0, 1)"),
        (args.sentence_tokens[1] > MAX_TOKENS, f"--sentence-tokens is at most {MAX_TOKENS} (the model's limit)"),
        (args.sentence_tokens[0] <= SPECIAL_TOKENS,
         f"--sentence-tokens must be more than {SPECIAL_TOKENS} ([CLS] and [SEP])"),
    ) if bad]
    rate = requests_per_s(args.quota, args.load, args.sentences, args.sentence_tokens) if not problems else 0.0
    if rate * args.minutes * 60 > MAX_REQUESTS:
        problems.append(f"that is over {MAX_REQUESTS:,} requests: lower --quota, --load or --minutes, or raise "
                        "--sentences")
    if problems:
        raise SystemExit("inferlb bench quota-accuracy: " + "; ".join(problems))
    if args.redis_url is None and shutil.which("redis-server") is None:
        raise SystemExit("inferlb bench quota-accuracy: redis-server not found (apt-get install redis-server), "
                         "or pass --redis-url")
    return Settings(args.quota, args.load, args.minutes * 60, args.clients, args.replicas, args.sentences,
                    args.sentence_tokens, args.tolerance, args.seed, args.redis_url, args.fit_window)


def main(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(settings, _print, args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="inferlb-bench-quota-accuracy-") as directory:
            result = asyncio.run(run(settings, _print, Path(directory)))
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


def _print(line: str) -> None:
    print(line, flush=True)
