"""``inferlb bench``: argument parsing only.

``inferlb bench load`` (one open-loop load against a URL) lives in
``load/load_command.py``; ``inferlb bench run`` (a scenario against every data-plane
configuration) in ``routing/run_command.py``; ``inferlb bench overload`` (issue 13's
classes and shedding) in ``fairness/overload.py``; ``inferlb bench hogs`` (short requests against
workers full of the largest ones, per worker scheduling option) in ``fairness/hogs.py``; ``inferlb bench fair``
(issue 14's fair shares: two tenants' weights on a saturated fleet, fair queue on and off) in
``fairness/fair.py``; ``inferlb bench autoscale`` (issue 15's elastic pool under a load step) in
``deploy/autoscale.py``; ``inferlb bench rollout`` (issue 15's canary split and rollback speed) in
``deploy/rollout.py``; ``inferlb bench faults`` (issue 20's faults under load) in
``reliability/faults.py``; ``inferlb bench soak`` (issue 20's soak: steady load, flat memory, connections and
accounting) in ``reliability/soak.py``; ``inferlb bench cache`` (issue 16's response cache, off and on,
under repeated inputs) in ``cache/cache.py``; the component
benchmarks ``inferlb bench worker`` in ``worker/worker_bench.py``, ``xds`` in ``xds_bench/``, ``ext-proc`` in
``ext_proc_bench/``, ``quota`` (a tenant's key lookup and quota check) in
``quota/quota_bench.py`` and ``quota-accuracy`` (tokens admitted per window against the
quota, two ext_proc replicas on one Redis) in ``quota/quota_accuracy.py``. Each keeps heavy imports (matplotlib,
the model, the services) inside its ``main`` so that ``inferlb --help`` stays fast.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType

from .cache import cache
from .deploy import autoscale, rollout
from .ext_proc_bench import command as ext_proc_command
from .fairness import fair, hogs, overload
from .load import load_command
from .quota import quota_accuracy, quota_bench
from .reliability import faults, soak
from .routing import run_command
from .worker import worker_bench
from .xds_bench import command as xds_command


@dataclass(frozen=True)
class _Command:
    """One ``inferlb bench`` subcommand: its module gives the description, the arguments and ``main``."""

    name: str
    module: ModuleType
    help: str
    raw: bool = False  # the description (and epilog) printed as written, not re-wrapped
    epilog: str | None = None


# In the order ``inferlb bench --help`` lists them.
_COMMANDS = (
    _Command("load", load_command, "one open-loop load against a URL"),
    _Command("run", run_command, "run a scenario against each data-plane configuration"),
    _Command("overload", overload, "130%% of capacity in three classes, with shedding and without"),
    _Command("fair", fair, "two tenants at weights 1 and 3 on a saturated fleet, with ext_proc's fair queue and "
             "without"),
    _Command("autoscale", autoscale, "an elastic pool (inferlb up --autoscale) under a load step "
             "10%% -> 150%% -> 10%% of one worker", raw=True, epilog=autoscale.EPILOG),
    _Command("rollout", rollout, "a 10%% canary's share of 2,000 requests, and how fast a blue-green switch and its "
             "rollback take effect"),
    _Command("cache", cache, "the response cache off and on at 30%% repeated inputs: throughput at the SLO and a "
             "hit's latency"),
    _Command("faults", faults, "one fault per run (kill -9 a worker, SIGSTOP, ext_proc, control plane, Envoy, a "
             "500-fast worker) under open-loop load at 70%% of capacity"),
    _Command("soak", soak, "10 minutes at 60%% of capacity: zero errors; flat RSS, descriptors, connections, metric "
             "series and outstanding work in every process"),
    _Command("hogs", hogs, "one-sentence requests while every worker holds the largest requests"),
    _Command("worker", worker_bench, "the worker: raw ONNX Runtime vs HTTP, batching, int8 vs fp32", raw=True),
    _Command("xds", xds_command, "the control plane: a weight change to every xDS client's ACK", raw=True),
    _Command("ext-proc", ext_proc_command, "ext_proc: added latency, decisions per CPU-second, its floor", raw=True),
    _Command("quota", quota_bench, "ext_proc's CPU per request for the key lookup and quota check, in process and "
             "with Redis", raw=True),
    _Command("quota-accuracy", quota_accuracy, "tokens admitted per minute against the quota: clients of one "
             "tenant at 3x it, ext_proc replicas sharing one Redis", raw=True),
)


def add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``inferlb bench`` and its subcommands, each parsed by its own module's ``add_arguments``."""
    bench = sub.add_parser(
        "bench",
        help="benchmark harness: open-loop load and scenario runs",
        description="Open-loop load generation (no coordinated omission) and side-by-side scenario runs "
        "of inferlb against Envoy's and NGINX's own balancers.",
    )
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    for command in _COMMANDS:
        parser = commands.add_parser(
            command.name, help=command.help, description=command.module.DESCRIPTION, epilog=command.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter if command.raw else argparse.HelpFormatter)
        command.module.add_arguments(parser)
        parser.set_defaults(func=command.module.main)
