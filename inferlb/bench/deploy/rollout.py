"""``inferlb bench rollout``: issue 15's canary split and rollback speed, live (see ``rollout_live.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .rollout_live import RolloutPlan

DESCRIPTION = """\
Issue 15's rollouts, live. A fresh stack on loopback (simulated workers that each serve two versions of
one model, control plane, ext_proc, Envoy). A canary: the alias's split is set to STABLE 90% / CANARY 10%
on the admin API and REQUESTS requests naming the alias are sent; the share each version served (the
worker's x-inferlb-model response header) is printed against the target (10% +- 2%). Then SWITCHES
times: the alias at STABLE 100%, a blue-green switch to CANARY 100%, and a rollback (POST .../rollback),
each timed from just before its admin call to every ext_proc replica's ACK of the EDS that carries it
(GET /v1/xds/clients) and to the first response served by the version switched to, while requests flow.
Targets: canary share within 2 points; a rollback in effect within 1 s. Takes under a minute."""

EPILOG = """\
examples:
  inferlb bench rollout
  inferlb bench rollout --canary-percent 25 --requests 4000 --json /tmp/rollout.json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = RolloutPlan()
    parser.add_argument("--canary-percent", type=float, default=d.canary_percent, metavar="P",
                        help=f"the canary's share of the alias's traffic (default {d.canary_percent:g})")
    parser.add_argument("--requests", type=int, default=d.requests,
                        help=f"requests counted under the canary split (default {d.requests})")
    parser.add_argument("--concurrency", type=int, default=d.concurrency,
                        help=f"of those, in flight at once (default {d.concurrency})")
    parser.add_argument("--switches", type=int, default=d.switches,
                        help=f"blue-green switch + rollback pairs timed (default {d.switches})")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/rollout)")


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def render(report: dict[str, Any]) -> str:
    """The table printed at the end."""
    s, plan = report["summary"], report["plan"]
    canary = report["canary"]
    lines = [
        f"rollout of {plan['alias']}: {plan['stable']} / {plan['canary']}",
        f"  canary {plan['canary_percent']:g}%: {canary['served'].get(plan['canary'], 0)} of {canary['requests']} "
        f"requests ({s['canary_share']:.1%}; target {plan['canary_percent']:g}% +- 2): "
        f"{'met' if s['canary_within_target'] else 'MISSED'}",
        f"  switch (max of {plan['switches']}): ext_proc ACK {s['switch_acked_max_s'] * 1e3:.0f} ms, "
        f"first response {s['switch_first_response_max_s'] * 1e3:.0f} ms",
        f"  rollback (max of {plan['switches']}): ext_proc ACK {s['rollback_acked_max_s'] * 1e3:.0f} ms, "
        f"first response {s['rollback_first_response_max_s'] * 1e3:.0f} ms (target <= 1 s): "
        f"{'met' if s['rollback_within_target'] else 'MISSED'}",
        f"  failed requests: {s['failures']}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from ..processes import ComponentDied
    from .rollout_live import RolloutRunner
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy

    plan = RolloutPlan(canary_percent=args.canary_percent, requests=args.requests, concurrency=args.concurrency,
                       switches=args.switches, workers=args.workers)
    problems = plan.problems()
    if problems:
        print(f"inferlb bench rollout: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if missing_envoy("inferlb bench rollout"):
        return 1
    out = (args.out or Path("bench-results") / "rollout").resolve()
    _report(f"rollout: {plan.workers} simulated workers serving {plan.stable} and {plan.canary}; logs in {out}")
    started = time.monotonic()
    try:
        live = run_on_uvloop(RolloutRunner(plan, out, _report).run())
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    except (ComponentDied, RuntimeError, TimeoutError) as exc:
        print(f"inferlb bench rollout: FAILED: {exc}", file=sys.stderr)
        return 1
    report = {"plan": asdict(plan), **live, "wall_s": round(time.monotonic() - started, 1)}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    met = report["summary"]["canary_within_target"] and report["summary"]["rollback_within_target"]
    return 0 if met and not report["summary"]["failures"] else 1
