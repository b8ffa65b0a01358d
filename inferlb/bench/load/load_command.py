"""``inferlb bench load``: one open-loop load against a URL, figures on stdout, RunResult JSON on request."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .scenario import DEFAULT_MIX, LengthBucket, Workload

DESCRIPTION = (
    "Send an open-loop load of real OpenAI embeddings requests to URL: each request at its scheduled time "
    "(Poisson or bursty arrivals, a seeded schedule), whether or not earlier ones have answered, and measure "
    "latency from the scheduled send time (no coordinated omission). Prints p50/p90/p99/p99.9, goodput "
    "(answers within the SLO per second), errors, timeouts and the spread over workers (from the "
    "x-inferlb-worker or x-inferlb-endpoint response header); --json writes the same figures as a RunResult."
)

EPILOG = """examples:
  inferlb bench load --url http://127.0.0.1:10000/v1/embeddings --rate 100 --duration 20
  inferlb bench load --url http://127.0.0.1:8101/v1/embeddings --rate 50 --arrival bursty --json out.json

--mix is SHARE:MIN-MAX[,...]: the share of requests whose input has MIN..MAX tokens (uniform, counting
[CLS] and [SEP]); shares add up to 1. The default is the issue's mix, 0.7:8-32,0.25:64-128,0.05:256-256."""


def parse_mix(text: str) -> tuple[LengthBucket, ...]:
    """``"0.7:8-32,0.3:64-128"`` → LengthBuckets; ``ValueError`` naming the bad part."""
    buckets = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        share, sep, span = part.partition(":")
        lo, dash, hi = span.partition("-")
        try:
            bucket = LengthBucket(float(share), int(lo), int(hi if dash else lo))
        except ValueError:
            raise ValueError(f"mix part {part!r} is not SHARE:MIN-MAX (e.g. 0.7:8-32)") from None
        if not sep or not bucket.share > 0 or not 3 <= bucket.min_tokens <= bucket.max_tokens <= 256:
            raise ValueError(f"mix part {part!r} needs SHARE > 0 and 3 <= MIN <= MAX <= 256")
        buckets.append(bucket)
    if not buckets:
        raise ValueError("mix is empty")
    total = sum(b.share for b in buckets)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"mix shares add up to {total:g}, not 1")
    return tuple(buckets)


def _mix_text(mix: tuple[LengthBucket, ...]) -> str:
    return ",".join(f"{b.share:g}:{b.min_tokens}-{b.max_tokens}" for b in mix)


def _positive(kind: type) -> object:
    def convert(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    convert.__name__ = f"positive {kind.__name__}"
    return convert


def _mix_arg(text: str) -> tuple[LengthBucket, ...]:
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--url", required=True, help="where to POST, e.g. http://127.0.0.1:10000/v1/embeddings")
    parser.add_argument("--rate", type=_positive(float), required=True, help="mean requests per second")
    parser.add_argument("--duration", type=_positive(float), default=20.0,
                        help="seconds of load, warm-up included (default 20)")
    parser.add_argument("--arrival", choices=["poisson", "bursty"], default="poisson",
                        help="poisson (default), or bursty: on/off periods with the same mean rate")
    parser.add_argument("--burst-on", type=_positive(float), default=1.0, metavar="S",
                        help="bursty: seconds on (default 1)")
    parser.add_argument("--burst-off", type=_positive(float), default=1.0, metavar="S",
                        help="bursty: seconds off (default 1)")
    parser.add_argument("--mix", type=_mix_arg, default=DEFAULT_MIX, metavar="SHARE:MIN-MAX,...",
                        help=f"input lengths in tokens (default {_mix_text(DEFAULT_MIX)})")
    parser.add_argument("--inputs", type=_positive(int), default=1, help="inputs per request (default 1)")
    parser.add_argument("--repeat-rate", type=float, default=0.0, metavar="R",
                        help="share of requests repeating an earlier text, for a cache to answer (default 0)")
    parser.add_argument("--repeat-pool", type=_positive(int), default=1000, metavar="N",
                        help="repeats are of the first N distinct texts sent (default 1000)")
    parser.add_argument("--zipf-s", type=_positive(float), default=1.1, metavar="S",
                        help="the repeats' Zipf exponent over that pool: the first text most often (default 1.1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the schedule and lengths (default 1)")
    parser.add_argument("--slo-ms", type=_positive(float), default=250.0,
                        help="latency objective for goodput (default 250)")
    parser.add_argument("--timeout", type=_positive(float), default=10.0, metavar="S",
                        help="a request with no answer after this many seconds is a timeout (default 10)")
    parser.add_argument("--warmup", type=float, default=0.0, metavar="S",
                        help="seconds at the start that are sent but not measured (default 0)")
    parser.add_argument("--connections", type=_positive(int), default=1024,
                        help="most open connections (default 1024)")
    parser.add_argument("--configuration", default="load", help="name written into the JSON (default 'load')")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the RunResult as JSON to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _fail(message: str) -> int:
    print(f"inferlb bench load: error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from .loadgen import run_load_blocking
    from .texts import bodies_for
    from .trace import build_trace

    if args.seed < 0:
        return _fail(f"--seed must be >= 0, got {args.seed}")
    if not 0 <= args.warmup < args.duration:
        return _fail(f"--warmup must be >= 0 and shorter than --duration ({args.duration:g} s), got {args.warmup}")
    if not args.url.startswith(("http://", "https://")):
        return _fail(f"--url must start with http:// or https://, got {args.url!r}")
    workload = Workload(mix=args.mix, inputs_per_request=args.inputs, arrival=args.arrival,
                        burst_on_s=args.burst_on, burst_off_s=args.burst_off, repeat_rate=args.repeat_rate,
                        repeat_pool=args.repeat_pool, repeat_zipf_s=args.zipf_s)
    try:
        trace = build_trace(workload, args.rate, args.duration, args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    bodies = bodies_for(trace.tokens, inputs=args.inputs, repeat_of=trace.repeat_of)
    slo_s = args.slo_ms / 1000
    outcome = run_load_blocking(args.url, trace, bodies, slo_s=slo_s, timeout_s=args.timeout,
                                warmup_s=args.warmup, progress=not args.no_progress,
                                max_connections=args.connections)
    result = outcome.to_result(args.configuration, extra={
        "url": args.url, "arrival": args.arrival, "mix": _mix_text(args.mix), "seed": args.seed,
        "inputs_per_request": args.inputs, "repeat_rate": args.repeat_rate})
    print(format_result(result))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        except OSError as exc:
            return _fail(f"cannot write {args.json}: {exc.strerror}")
    return 0


def format_result(r) -> str:  # type: ignore[no-untyped-def]
    """The human summary of a RunResult (a few aligned lines)."""
    ms = 1000.0
    lines = [
        f"offered   {r.offered_rps:.1f} req/s for {r.duration_s:g} s measured: sent {r.sent}, completed "
        f"{r.completed}, errors {r.errors}, timeouts {r.timeouts}",
        f"latency   p50 {r.p50_s * ms:.2f} ms  p90 {r.p90_s * ms:.2f} ms  p99 {r.p99_s * ms:.2f} ms  "
        f"p99.9 {r.p999_s * ms:.2f} ms  mean {r.mean_s * ms:.2f} ms",
        f"goodput   {r.goodput_rps:.1f} req/s within {r.slo_s * ms:g} ms",
    ]
    if r.spread:
        total = sum(r.spread.values()) or 1
        lines.append("spread    " + "  ".join(f"{k} {v} ({100 * v / total:.0f}%)" for k, v in r.spread.items()))
    extra = r.extra
    if "client_cpu_s" in extra:
        lines.append(f"client    cpu {extra['client_cpu_s']:.2f} s, send lag p99 "
                     f"{extra.get('send_lag_p99_s', 0) * ms:.2f} ms max {extra.get('send_lag_max_s', 0) * ms:.2f} ms")
    if extra.get("error_kinds") or any(k != "200" for k in extra.get("statuses", {})):
        lines.append(f"errors    statuses {extra.get('statuses')} kinds {extra.get('error_kinds')}")
    return "\n".join(lines)
