"""Issue 19's real-worker target: inferlb's p99 against the best peer's, at each load.

The peers are the proxies' own balancers (Envoy round robin, least_request,
CSWRR with ORCA, NGINX least_conn); "best" is whichever had the lowest p99 at
that load, so the target does not depend on which peer happens to suit the
fleet. The target is p99 <= 0.7x the best peer at 80% load.
"""

from __future__ import annotations

from typing import Sequence

from ..report.results import RunResult
from ..report.table import SUBJECT, TARGET_LOAD, find

PEERS = ("envoy_round_robin", "envoy_least_request", "envoy_cswrr_orca", "nginx_least_conn")
TARGET_RATIO = 0.7


def best_peer(results: Sequence[RunResult], load: float) -> RunResult | None:
    """The peer run with the lowest p99 at ``load`` (steady runs), or None when no peer ran there."""
    runs = [r for r in (find(results, peer, load=load) for peer in PEERS) if r is not None]
    return min(runs, key=lambda r: r.p99_s) if runs else None


def best_peer_lines(results: Sequence[RunResult], subject: str = SUBJECT) -> list[str]:
    """A markdown table: per load, the subject's p99 and goodput against the best peer's, the target marked."""
    loads = sorted({r.load for r in results if r.run == "steady"})
    rows = []
    for load in loads:
        mine, peer = find(results, subject, load=load), best_peer(results, load)
        if mine is None or peer is None or peer.p99_s <= 0:
            continue
        ratio = mine.p99_s / peer.p99_s
        verdict = ""
        if abs(load - TARGET_LOAD) < 1e-9:
            verdict = "met" if ratio <= TARGET_RATIO else "missed"
        rows.append(f"| {load:.0%} | {mine.p99_s * 1e3:.1f} | {peer.configuration} | {peer.p99_s * 1e3:.1f} "
                    f"| {ratio:.2f}x | {mine.goodput_rps:.1f} / {peer.goodput_rps:.1f} | {verdict} |")
    if not rows:
        return []
    return ["", f"## {subject} against the best peer (target: p99 <= {TARGET_RATIO}x at {TARGET_LOAD:.0%})", "",
            f"| load | {subject} p99 ms | best peer (lowest p99) | its p99 ms | ratio | goodput/s (mine / peer) | "
            "target |", "|---:|---:|---|---:|---:|---:|---|", *rows, ""]
