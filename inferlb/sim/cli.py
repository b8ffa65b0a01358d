"""``inferlb sim``: argument parsing only; the simulator lives beside it (imported lazily)."""

from __future__ import annotations

import argparse


def add_sim_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    sim = sub.add_parser("sim", help="discrete-event fleet simulator")
    sim.set_defaults(func=lambda args: (print("inferlb sim: not built yet"), 2)[1])
