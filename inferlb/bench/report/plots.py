"""PNG plots of bench (or simulator) results: latency CDFs and latency against offered load.

matplotlib is imported inside each function with the Agg backend (no
display, no GUI toolkit), so importing this module costs nothing and the
CLI's ``--help`` stays fast.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .results import RunResult


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _label(r: RunResult) -> str:
    return r.configuration if r.source == "live" else f"{r.configuration} ({r.source})"


def plot_cdfs(results: Sequence[RunResult], path: str | Path, *, title: str | None = None) -> Path:
    """One latency CDF per result (log-x, from each result's ``cdf`` points), e.g. every configuration
    at one load, with the SLO as a vertical line. Results without CDF points are left out."""
    plt = _pyplot()
    shown = [r for r in results if r.cdf]
    if not shown:
        raise ValueError("no result has CDF points to plot")
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for r in shown:
            xs = [max(x, 1e-6) for x, _ in r.cdf]
            ys = [y for _, y in r.cdf]
            ax.step(xs, ys, where="post", label=_label(r))
        slo = shown[0].slo_s
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo * 1000:g} ms")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.0)
        ax.set_xlabel("latency from scheduled send (s, log)")
        ax.set_ylabel("fraction of requests")
        loads = sorted({r.load for r in shown})
        ax.set_title(title or "latency CDF at load " + ", ".join(f"{x:g}" for x in loads))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out


def plot_load_latency(results: Sequence[RunResult], path: str | Path, *, title: str | None = None) -> Path:
    """p99 (solid) and p50 (dotted) latency against offered load (req/s), one colour per configuration,
    with the SLO as a horizontal line. Log-y: the interesting differences are in the tail."""
    plt = _pyplot()
    if not results:
        raise ValueError("no results to plot")
    series: dict[str, list[RunResult]] = defaultdict(list)
    for r in results:
        series[_label(r)].append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name, rs in series.items():
            rs.sort(key=lambda r: r.offered_rps)
            x = [r.offered_rps for r in rs]
            (line,) = ax.plot(x, [max(r.p99_s, 1e-6) for r in rs], marker="o", label=f"{name} p99")
            ax.plot(x, [max(r.p50_s, 1e-6) for r in rs], marker=".", linestyle=":", color=line.get_color(),
                    label=f"{name} p50")
        slo = results[0].slo_s
        ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo * 1000:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("latency (s, log)")
        ax.set_title(title or "latency against offered load")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out
