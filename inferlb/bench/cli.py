"""``inferlb bench``: argument parsing only; the work lives in the bench modules (imported lazily)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser("bench", help="benchmark harness: open-loop load and scenario runs")
    bench.set_defaults(func=lambda args: (print("inferlb bench: not built yet"), 2)[1])
