"""The xDS bench's progress lines and final table."""

from __future__ import annotations

from typing import Any

from .spec import Spec


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def progress_line(spec: Spec, result: dict[str, Any]) -> str:
    s = result.get("summary") or {}
    if not s:
        return f"{spec.label}: FAILED {result.get('error')}"
    line = (f"{spec.label}: conv median {s['conv_ms_median']:.1f} ms max {s['conv_ms_max']:.1f} ms | "
            f"push {s['push_ms_median']:.1f} ms | build {s['build_ms_median']:.1f} ms | "
            f"EDS {fmt_bytes(s['eds_push_bytes'] or result.get('cla_bytes'))}/push | "
            f"cpu {s['cpu_s_median']:.3f} s/change ({s['cpu_pct_median']:.0f}%) | RSS {s['rss_mb_max']:.0f} MB")
    if "target_ms" in s:
        line += f" | target <= {s['target_ms']:.0f} ms: {'MET' if s['target_met'] else 'MISSED'}"
    if result.get("error"):
        line += f" | ERROR {result['error']}"
    return line


def table(results: list[dict[str, Any]]) -> str:
    header = ("mode", "change", "endpoints", "clients", "conv med ms", "conv max ms", "push med ms", "build ms",
              "EDS B/push", "EDS B/change", "CPU s/chg", "CPU %", "RSS MB", "target")
    rows = [header]
    for r in results:
        spec, s = r["spec"], r.get("summary") or {}
        clients = f"{spec['clients']}{'+E' if spec['envoy'] else ''}"
        if not s:
            rows.append((spec["mode"], spec["change"], str(spec["endpoints"]), clients,
                         "FAILED", "", "", "", "", "", "", "", "", (r.get("error") or "")[:60]))
            continue
        target = "-"
        if "target_ms" in s:
            target = f"<={s['target_ms']:.0f} {'MET' if s['target_met'] else 'MISSED'}"
        rows.append((spec["mode"], spec["change"], str(spec["endpoints"]), clients,
                     f"{s['conv_ms_median']:.1f}", f"{s['conv_ms_max']:.1f}", f"{s['push_ms_median']:.1f}",
                     f"{s['build_ms_median']:.1f}", fmt_bytes(s["eds_push_bytes"] or r.get("cla_bytes")),
                     fmt_bytes(s["eds_bytes_per_change"]), f"{s['cpu_s_median']:.3f}",
                     f"{s['cpu_pct_median']:.0f}", f"{s['rss_mb_max']:.0f}", target))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i >= 2 and i < len(header) - 1 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
