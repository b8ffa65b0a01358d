"""``inferlb bench hogs``'s figures and how they are judged: one row per run, the medians over rounds, the
tables.

Issue 37's targets, each judged per row:
- sentences: p99 <= 100 ms with 0 errors (any answer but 200, or none);
- work-conserving (Envoy modes): the hogs' tokens per second beside the sentences are >= 90% of the
  fleet's with the hogs alone (the workers' token counters over each window, the sentences' own tokens
  taken out);
- early refusal (Envoy modes): the hogs' 429s come in p99 <= 5 ms, and none after waiting.
For direct, "with sentences" is the hogs' tokens over their makespan: the fleet's rate with every worker's
queue full and no door in the way, to set the Envoy modes' rates against.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..report.table import ms
from .hogs_live import SENTENCE_TOKENS, Measured
from .hogs_load import EARLY, ERROR, OK, OTHER_429, WAITED
from .hogs_plan import DIRECT

TARGET_P99_S = 0.100
TARGET_RATIO = 0.90
TARGET_429_P99_S = 0.005


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def figures(m: Measured) -> dict[str, Any]:
    """One run's row: the sentences' latency and errors, the hogs' throughput and 429s."""
    s, o = m.sentences.histogram.summary(), m.sentences
    row: dict[str, Any] = {
        "mode": m.spec.mode, "order": m.spec.order, "scheduling": m.spec.scheduling, "round": m.spec.round,
        "sentences_sent": o.sent, "sentences_completed": o.completed, "sentence_errors": o.errors + o.timeouts,
        "sentence_statuses": {str(k): v for k, v in sorted(o.statuses.items())},
        "sentence_p50_s": s.p50_s if o.completed else None, "sentence_p99_s": s.p99_s if o.completed else None,
        "sentence_max_s": s.max_s if o.completed else None, "sentence_send_lag_p99_s": o.send_lag_p99_s,
    }
    kinds = {k: [a.seconds for a in m.hogs if a.kind == k] for k in (OK, EARLY, WAITED, OTHER_429, ERROR)}
    refusals = kinds[EARLY] + kinds[WAITED] + kinds[OTHER_429]
    row.update({
        "hogs_ended": len(m.hogs), "hogs_cancelled_at_stop": m.hogs_cancelled, "hogs_ok": len(kinds[OK]),
        "hog_p50_s": _pct(kinds[OK], 50),
        "hog_429s": len(refusals), "hog_429_early": len(kinds[EARLY]), "hog_429_after_waiting": len(kinds[WAITED]),
        "hog_429_other": len(kinds[OTHER_429]), "hog_429_p50_s": _pct(refusals, 50),
        "hog_429_p99_s": _pct(refusals, 99), "hog_429_early_p99_s": _pct(kinds[EARLY], 99),
        "hog_errors": len(kinds[ERROR]),
    })
    if m.spec.mode == DIRECT:
        # the fleet's rate with every worker's queue full (no door): the hogs' tokens over their makespan
        tokens = sum(a.tokens for a in m.hogs)
        row.update({"hogs_done_at_last_sentence_sent": m.hogs_done_at_last_sentence_sent,
                    "hog_makespan_s": m.hog_makespan_s,
                    "hog_tokens_per_s_with_sentences": tokens / m.hog_makespan_s if m.hog_makespan_s else None})
        return row
    rates = {}
    for phase, (start, end) in m.windows.items():
        tokens = m.fleet_tokens[phase] - (o.completed * SENTENCE_TOKENS if phase == "with_sentences" else 0)
        rates[phase] = tokens / (end - start) if end > start else 0.0
        row[f"hog_answered_tokens_per_s_{phase}"] = answered_rate(m, start, end)
    row.update({"hog_tokens_per_s_alone": rates["alone"], "hog_tokens_per_s_with_sentences": rates["with_sentences"],
                "hog_throughput_ratio": rates["with_sentences"] / rates["alone"] if rates["alone"] else None})
    return row


def answered_rate(m: Measured, start: float, end: float) -> float:
    """Tokens of the hogs answered 200 within [start, end), per second (coarse: whole hogs)."""
    return sum(a.tokens for a in m.hogs if start <= a.ended < end) / (end - start) if end > start else 0.0


# --- verdicts -------------------------------------------------------------------------------------------


def sentence_verdict(row: dict[str, Any]) -> str:
    p99 = row["sentence_p99_s"]
    if row["mode"] == DIRECT and row.get("hogs_done_at_last_sentence_sent") is not None \
            and row["hogs_done_at_last_sentence_sent"] >= row["hogs_ended"]:
        return "INVALID (every hog had ended before the last sentence was sent)"
    if p99 is None or row["sentence_errors"]:
        return "MISSED (errors)"
    return "met" if p99 <= TARGET_P99_S else "MISSED"


def throughput_verdict(row: dict[str, Any]) -> str:
    ratio = row.get("hog_throughput_ratio")
    if row["mode"] == DIRECT:
        return "-"
    if ratio is None:
        return "MISSED (no hog throughput alone)"
    return "met" if ratio >= TARGET_RATIO else "MISSED"


def refusal_verdict(row: dict[str, Any]) -> str:
    if row["mode"] == DIRECT:
        return "-"
    if row["hog_429_after_waiting"]:
        return f"MISSED ({row['hog_429_after_waiting']} after waiting)"
    if not row["hog_429s"]:
        return "met (no 429)"
    return "met" if row["hog_429_p99_s"] <= TARGET_429_P99_S else "MISSED"


# --- medians over rounds --------------------------------------------------------------------------------

MEDIAN_FIGURES = ("sentence_p50_s", "sentence_p99_s", "sentence_max_s", "hog_p50_s", "hog_429_p50_s",
                  "hog_429_p99_s", "hog_429_early_p99_s", "hog_tokens_per_s_alone", "hog_tokens_per_s_with_sentences",
                  "hog_throughput_ratio", "hog_makespan_s")
SUMMED_FIGURES = ("sentences_sent", "sentences_completed", "sentence_errors", "hogs_ended", "hogs_ok", "hog_429s",
                  "hog_429_early", "hog_429_after_waiting", "hog_429_other", "hog_errors")


def medians(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, order, scheduling): each time and rate the median over its rounds (with the
    sentences' p99 range), each count summed; in the order each first appears."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["order"], row["scheduling"]), []).append(row)
    out = []
    for (mode, order, scheduling), rs in groups.items():
        row: dict[str, Any] = {"mode": mode, "order": order, "scheduling": scheduling, "round": 0, "rounds": len(rs)}
        for name in MEDIAN_FIGURES:
            values = [r[name] for r in rs if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        for name in SUMMED_FIGURES:
            row[name] = sum(r[name] for r in rs)
        p99s = [r["sentence_p99_s"] for r in rs if r["sentence_p99_s"] is not None]
        row["sentence_p99_min_s"], row["sentence_p99_max_s"] = (min(p99s), max(p99s)) if p99s else (None, None)
        if mode == DIRECT:
            row["hogs_done_at_last_sentence_sent"] = min(r["hogs_done_at_last_sentence_sent"] for r in rs)
        out.append(row)
    return out


# --- tables ---------------------------------------------------------------------------------------------


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: one line per run, every target judged."""
    lines = ["| mode | order | scheduling | sentences | p50 ms | p99 ms | errors | "
             f"p99 <= {TARGET_P99_S * 1e3:.0f} ms | hog tokens/s alone | with sentences | ratio | "
             f">= {TARGET_RATIO:.0%} | hogs ok | hog 429s (after waiting) | 429 p50 / p99 ms | hog errors | "
             f"429 p99 <= {TARGET_429_P99_S * 1e3:.0f} ms, none after waiting |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = (f" ({ms(r['sentence_p99_min_s'])}-{ms(r['sentence_p99_max_s'])})"
                  if r.get("rounds", 1) > 1 and r.get("sentence_p99_min_s") is not None else "")
        lines.append(
            f"| {r['mode']} | {r['order']} | {r['scheduling']} | {r['sentences_completed']}/{r['sentences_sent']} | "
            f"{ms(r['sentence_p50_s'])} | {ms(r['sentence_p99_s'])}{spread} | {r['sentence_errors']} | "
            f"{sentence_verdict(r)} | {_n(r.get('hog_tokens_per_s_alone'))} | "
            f"{_n(r.get('hog_tokens_per_s_with_sentences'))} | {_n(r.get('hog_throughput_ratio'), 2)} | "
            f"{throughput_verdict(r)} | {r['hogs_ok']}/{r['hogs_ended']} | {r['hog_429s']} "
            f"({r['hog_429_after_waiting']}) | {ms(r['hog_429_p50_s'])} / {ms(r['hog_429_p99_s'])} | "
            f"{r['hog_errors']} | {refusal_verdict(r)} |")
    return lines


def render(report: dict[str, Any]) -> str:
    """The plan, a table per round, and (with more than one round) the medians."""
    plan = report["plan"]
    lines = [f"hogs: {plan['workers']} workers; through Envoy {plan['hog_concurrency']} hogs of "
             f"{plan['hog_inputs']} x {plan['hog_tokens']} tokens kept in flight ({plan['alone_s']:g} s alone, "
             f"then beside the sentences); direct: {plan['inputs_per_worker'] // plan['hog_inputs']} hogs per "
             f"worker; {plan['sentences']} one-sentence requests at {plan['rate_rps']:g}/s through Envoy; "
             f"max_batch_tokens {plan['max_batch_tokens'] or 'default'}; every input unique"]
    rounds = sorted({r["round"] for r in report["runs"]})
    for n in rounds:
        lines += ["", *([f"round {n}:"] if len(rounds) > 1 else []),
                  *render_table([r for r in report["runs"] if r["round"] == n])]
    if len(rounds) > 1:
        lines += ["", f"medians over {len(rounds)} rounds (sentence p99 range in brackets):",
                  *render_table(report["medians"])]
    for failure in report["failures"]:
        lines.append(f"FAILED: round {failure['round']} {failure['run']}: {failure['error']}")
    return "\n".join(lines)
