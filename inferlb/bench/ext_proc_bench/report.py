"""The ext_proc bench's report: its targets, and the table printed after the progress lines."""

from __future__ import annotations

from typing import Any

from .stack import Log

TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P50_RATE = 500
TARGET_DECISIONS_PER_S = 4000.0
DIRECT_ROWS = (("ext_proc_tcp", "ext_proc over TCP (real token counting)"),
               ("ext_proc_uds", "ext_proc over UDS (real token counting)"),
               ("ext_proc_grpcio_tcp", "ext_proc on grpcio's front over TCP"),
               ("ext_proc_grpcio_uds", "ext_proc on grpcio's front over UDS"),
               ("trivial_tcp", "trivial grpcio aio servicer over TCP"),
               ("trivial_uds", "trivial grpcio aio servicer over UDS"),
               ("trivial_native_tcp", "trivial servicer, native front, TCP"),
               ("trivial_native_uds", "trivial servicer, native front, UDS"))
# ext_proc's decisions per CPU-second against another server's in the same run: (its key, the line's words)
RATIOS = (("trivial_{}", "ext_proc per CPU-second / the trivial servicer's over {}"),
          ("trivial_native_{}", "ext_proc per CPU-second / the native trivial servicer's over {}"),
          ("ext_proc_grpcio_{}", "ext_proc per CPU-second, native front / grpcio's, over {}"))


def fmt(value: float | None, width: int = 7, digits: int = 2, sign: bool = False) -> str:
    if value is None:
        return "-".rjust(width)
    return f"{value:+{width}.{digits}f}" if sign else f"{value:{width}.{digits}f}"


def report(results: dict[str, Any], args: Any, log: Log) -> None:
    """The figures as a table, after the progress lines: one section per phase that ran, then the targets
    and the profiles."""
    _machine(results, args, log)
    _overhead(results, args, log)
    _saturation_stack(results, args, log)
    _saturation_fake_worker(results, args, log)
    _direct(results, log)
    _targets(results, log)
    _profiles(results, log)


def _machine(results: dict[str, Any], args: Any, log: Log) -> None:
    """The header: the machine, its load, the stack's settings."""
    m = results["machine"]
    log("")
    log(f"== ext_proc benchmark: {m['cpus']} CPUs, shared machine (load average {m['loadavg_start'][0]:.2f} at start, "
        f"{m['loadavg_end'][0]:.2f} at end); Envoy --concurrency 1; {args.workers} simulated workers "
        f"({args.sim_fixed_ms:g} ms + {args.sim_per_token_us:g} us/token) ==")


def _overhead(results: dict[str, Any], args: Any, log: Log) -> None:
    """The added latency per rate (open loop), and the filter's floor where measured."""
    overhead = results.get("overhead", {})
    if not overhead:
        return
    log(f"Overhead: open loop, {args.arrivals} arrivals, latency in ms from the scheduled send time, "
        f"{args.duration:g} s per configuration and rate in {args.rounds} interleaved round(s); fail-open: "
        f"requests Envoy let through without a pick (ext_proc over its 200 ms message timeout)")
    log(f"{'rate/s':>6} | {'baseline p50':>12} {'p99':>7} | {'ext_proc p50':>12} {'p99':>7} | "
        f"{'added p50':>9} {'p99':>7} | {'errors b/x':>10} | {'fail-open':>9} | {'ext_proc CPU':>12} | "
        f"generator: lag p99, CPU, kept up")
    for rate, e in overhead.items():
        b, x, a = e["baseline"], e["ext_proc"], e["added"]
        lag = max(b["lag_p99_ms"] or 0, x["lag_p99_ms"] or 0)
        gen = max(b["generator_cores"], x["generator_cores"])
        kept = "yes" if b["generator_kept_up"] and x["generator_kept_up"] else "NO"
        log(f"{rate:>6} | {fmt(b['p50_ms'], 12)} {fmt(b['p99_ms'])} | {fmt(x['p50_ms'], 12)} {fmt(x['p99_ms'])} | "
            f"{fmt(a['p50_ms'], 9, sign=True)} {fmt(a['p99_ms'], sign=True)} | "
            f"{str(b['errors']) + '/' + str(x['errors']):>10} | {x['failure_mode_allowed']:>9} | "
            f"{x['cores']['ext_proc']:7.2f} core | "
            f"{lag:.2f} ms, {gen:.2f} core, {kept}")
        if "filter_floor" in e:
            f, fa = e["filter_floor"], e["filter_floor_added"]
            log(f"{'':>6} | {'filter floor':>12} {'':>7} | {fmt(f['p50_ms'], 12)} {fmt(f['p99_ms'])} | "
                f"{fmt(fa['p50_ms'], 9, sign=True)} {fmt(fa['p99_ms'], sign=True)} | {'-/' + str(f['errors']):>10} |")
    if any("filter_floor" in e for e in overhead.values()):
        log(f"  filter floor: a static Envoy with the ext_proc filter and a trivial servicer on the "
            f"{results.get('ext_proc_front', 'grpcio')} front "
            "(constant answers, no pick) in front of the same workers: what three round trips cost with no work")


def _saturation_stack(results: dict[str, Any], args: Any, log: Log) -> None:
    """Saturation through the whole stack (wrk)."""
    sat = results.get("saturation_stack", {})
    if not sat:
        return
    b, x = sat["baseline"], sat["ext_proc"]
    log(f"Saturation through the stack (wrk, {args.wrk_connections} connections, simulated workers): no filter "
        f"{b['rps']:.0f} req/s; ext_proc {x['rps']:.0f} req/s, {x['decisions_per_s']:.0f} decisions/s at "
        f"{x['cores']['ext_proc']:.2f} ext_proc cores ({x.get('per_server_cpu_s') or 0:.0f} per CPU-second), "
        f"fail-open {x['envoy_filter']['failure_mode_allowed']}")


def _saturation_fake_worker(results: dict[str, Any], args: Any, log: Log) -> None:
    """Saturation through Envoy to a fake worker, per configuration."""
    fake = results.get("saturation_fake_worker", {})
    if not fake:
        return
    log(f"Saturation through Envoy to a fake worker (an Envoy answering a worker's real answer; wrk, "
        f"{args.wrk_connections} connections, {args.wrk_rounds} round(s) in rotated order):")
    for key, e in fake.items():
        server = "ext_proc" if key.startswith("ext_proc") else "trivial" if key.startswith("trivial") else None
        tail = (f"{e.get('decisions_per_s', e['rps']):7.0f} {'decisions' if 'decisions_per_s' in e else 'streams'}/s, "
                f"{e['server_cores']:.2f} {server} cores -> {e['per_server_cpu_s']:6.0f} per CPU-second"
                if server and e.get("server_cores") else "")
        every = f"  (median of rounds {e['rounds']})" if len(e.get("rounds", ())) > 1 else ""
        log(f"  {e['label']:<40} {e['rps']:7.0f} req/s  Envoy {e['cores']['envoy']:.2f} core  {tail}{every}")
    if "trivial_1" in fake:
        log("  * body only = request headers SKIP: Envoy's router picks the host on the request headers, before "
            "ext_proc answers the body, so override_host never sees the pick: a floor, not an option.")


def _direct(results: dict[str, Any], log: Log) -> None:
    """ext_proc alone under a gRPC client, against the trivial servicers, and the ratios of the same run."""
    direct = results.get("saturation_grpc", {})
    if not direct:
        return
    log(f"ext_proc alone (on its {results.get('ext_proc_front', 'grpcio')} front): a gRPC client playing Envoy's "
        "3 messages per request; server pinned to one core, client on the other:")
    for key, label in DIRECT_ROWS:
        if key in direct:
            e = direct[key]
            log(f"  {label:<40} {e['per_s']:7.0f}/s at {e['cores']['server']:.2f} server cores -> "
                f"{e['per_cpu_s'] or 0:6.0f} per CPU-second (client {e['cores']['client']:.2f} cores)")
    for other, ratio in RATIOS:
        for transport in ("tcp", "uds"):
            x, t = direct.get(f"ext_proc_{transport}"), direct.get(other.format(transport))
            if x and t and t.get("per_cpu_s"):
                log(f"  {ratio.format(transport.upper())} (same run): {(x['per_cpu_s'] or 0) / t['per_cpu_s']:.2f}")
    tcp, uds = direct.get("ext_proc_tcp"), direct.get("ext_proc_uds")
    if tcp and uds and tcp.get("per_cpu_s"):
        log(f"  ext_proc over UDS / over TCP, per CPU-second: {(uds['per_cpu_s'] or 0) / tcp['per_cpu_s']:.2f}")


def _targets(results: dict[str, Any], log: Log) -> None:
    """Issue 4's targets and their verdicts (see ``targets``)."""
    tg = results.get("targets", {})
    if not tg:
        return
    log("Targets:")
    for name, t in tg.items():
        verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "MISSED")
        log(f"  {name:<40} {t['value']} -> {verdict}")


def _profiles(results: dict[str, Any], log: Log) -> None:
    """Where ext_proc's CPU goes: perf by shared object, cProfile by category and top functions."""
    prof = results.get("profile", {})
    perf = prof.get("perf", {})
    if "by_group_percent" in perf:
        log("perf record of ext_proc under the gRPC load (share of its CPU samples, by shared object):")
        for label, share in perf["by_group_percent"].items():
            log(f"  {share:5.1f}%  {label}")
    elif perf:
        log(f"perf: {perf.get('skipped')}")
    cp = prof.get("cprofile", {})
    if "by_category_s" in cp:
        made = cp["load"]["decisions"] or 0
        log(f"cProfile of ext_proc's main thread ({cp['profiled_s']:.1f} s profiled incl. start-up, {made:.0f} "
            f"decisions; cProfile slows Python code, so read shares, not absolute times):")
        busy = cp["busy_s"] or 1e-9
        for label, seconds in cp["by_category_s"].items():
            excluded = label.startswith(("idle", "start-up"))
            share = "" if excluded else f"{seconds / busy * 100:5.1f}% of busy"
            per = "" if excluded else f"{cp['us_per_decision_by_category'].get(label, 0):6.0f} us/decision"
            log(f"  {label:<62} {seconds:6.2f} s {share:>15} {per}")
        log("  top functions by own time:")
        for row in cp["top_own_time"]:
            log(f"    {row['own_s']:6.3f} s {row['calls']:>8} calls  {row['function']}")


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Each target of issue 4: its measured value and whether it was met (None: not measured)."""
    out: dict[str, Any] = {}
    e = results.get("overhead", {}).get(str(TARGET_ADDED_P50_RATE))
    added = e["added"]["p50_ms"] if e else None
    out[f"added p50 <= {TARGET_ADDED_P50_MS:g} ms at {TARGET_ADDED_P50_RATE} req/s"] = {
        "value": f"{added:+.2f} ms" if added is not None else "not measured",
        "met": None if added is None else added <= TARGET_ADDED_P50_MS}
    name = f">= {TARGET_DECISIONS_PER_S:.0f} decisions/s on one core"
    direct = results.get("saturation_grpc", {}).get("ext_proc")
    if direct and direct.get("per_cpu_s"):
        # Pinned to one core: decisions per CPU-second is what that core sustains (= decisions/s when the
        # client saturated it; an extrapolation when ext_proc used less than the core).
        value = direct["per_cpu_s"]
        out[name] = {"value": f"{direct['per_s']:.0f}/s at {direct['cores']['server']:.2f} cores = "
                              f"{value:.0f} per CPU-second", "met": value >= TARGET_DECISIONS_PER_S}
    else:
        fake = results.get("saturation_fake_worker", {}).get("ext_proc")
        value = fake.get("per_server_cpu_s") if fake else None
        out[name] = {"value": f"{value:.0f} per CPU-second (through Envoy)" if value else "not measured",
                     "met": None if value is None else value >= TARGET_DECISIONS_PER_S}
    return out
