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


def add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark harness: open-loop load and scenario runs",
        description="Open-loop load generation (no coordinated omission) and side-by-side scenario runs "
        "of inferlb against Envoy's and NGINX's own balancers.",
    )
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    load = commands.add_parser("load", help="one open-loop load against a URL",
                               description=load_command.DESCRIPTION)
    load_command.add_arguments(load)
    load.set_defaults(func=load_command.main)
    run = commands.add_parser("run", help="run a scenario against each data-plane configuration",
                              description=run_command.DESCRIPTION)
    run_command.add_arguments(run)
    run.set_defaults(func=run_command.main)
    over = commands.add_parser("overload", help="130%% of capacity in three classes, with shedding and without",
                               description=overload.DESCRIPTION)
    overload.add_arguments(over)
    over.set_defaults(func=overload.main)
    fair_ = commands.add_parser("fair", help="two tenants at weights 1 and 3 on a saturated fleet, with ext_proc's "
                                "fair queue and without", description=fair.DESCRIPTION)
    fair.add_arguments(fair_)
    fair_.set_defaults(func=fair.main)
    scale = commands.add_parser("autoscale", help="an elastic pool (inferlb up --autoscale) under a load step "
                                "10%% -> 150%% -> 10%% of one worker", description=autoscale.DESCRIPTION,
                                epilog=autoscale.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    autoscale.add_arguments(scale)
    scale.set_defaults(func=autoscale.main)
    roll = commands.add_parser("rollout", help="a 10%% canary's share of 2,000 requests, and how fast a blue-green "
                               "switch and its rollback take effect", description=rollout.DESCRIPTION)
    rollout.add_arguments(roll)
    roll.set_defaults(func=rollout.main)
    cached = commands.add_parser("cache", help="the response cache off and on at 30%% repeated inputs: throughput "
                                 "at the SLO and a hit's latency", description=cache.DESCRIPTION)
    cache.add_arguments(cached)
    cached.set_defaults(func=cache.main)
    fault = commands.add_parser("faults", help="one fault per run (kill -9 a worker, SIGSTOP, ext_proc, control "
                                "plane, Envoy, a 500-fast worker) under open-loop load at 70%% of capacity",
                                description=faults.DESCRIPTION)
    faults.add_arguments(fault)
    fault.set_defaults(func=faults.main)
    soaked = commands.add_parser("soak", help="10 minutes at 60%% of capacity: zero errors; flat RSS, descriptors, "
                                 "connections, metric series and outstanding work in every process",
                                 description=soak.DESCRIPTION)
    soak.add_arguments(soaked)
    soaked.set_defaults(func=soak.main)
    hog = commands.add_parser("hogs", help="one-sentence requests while every worker holds the largest requests",
                              description=hogs.DESCRIPTION)
    hogs.add_arguments(hog)
    hog.set_defaults(func=hogs.main)
    worker = commands.add_parser("worker", help="the worker: raw ONNX Runtime vs HTTP, batching, int8 vs fp32",
                                 description=worker_bench.DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_bench.add_arguments(worker)
    worker.set_defaults(func=worker_bench.main)
    xds = commands.add_parser("xds", help="the control plane: a weight change to every xDS client's ACK",
                              description=xds_command.DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    xds_command.add_arguments(xds)
    xds.set_defaults(func=xds_command.main)
    ext_proc = commands.add_parser("ext-proc", help="ext_proc: added latency, decisions per CPU-second, its floor",
                                   description=ext_proc_command.DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    ext_proc_command.add_arguments(ext_proc)
    ext_proc.set_defaults(func=ext_proc_command.main)
    quota = commands.add_parser("quota", help="ext_proc's CPU per request for the key lookup and quota check, "
                                "in process and with Redis",
                                description=quota_bench.DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    quota_bench.add_arguments(quota)
    quota.set_defaults(func=quota_bench.main)
    accuracy = commands.add_parser("quota-accuracy", help="tokens admitted per minute against the quota: clients "
                                   "of one tenant at 3x it, ext_proc replicas sharing one Redis",
                                   description=quota_accuracy.DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    quota_accuracy.add_arguments(accuracy)
    accuracy.set_defaults(func=quota_accuracy.main)
