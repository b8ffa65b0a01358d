"""``inferlb bench load``: placeholder until it is built."""

from __future__ import annotations

import argparse

DESCRIPTION = "not built yet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    print("inferlb bench load: not built yet")
    return 2
