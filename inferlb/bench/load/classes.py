"""Which class each request of a trace is sent as, drawn from the scenario's class mix.

Drawn from its own child stream of the trace's seed (the third; the trace
uses the first two), so the live bench and the simulator give the same
request the same class, and a class mix never moves the arrivals or lengths.
"""

from __future__ import annotations

import numpy as np

from inferlb_runtime.request_class import OBJECTIVE_HEADER, Priority

from .scenario import ClassMix


def trace_classes(classes: ClassMix, n: int, seed: int) -> np.ndarray:
    """``n`` ``Priority`` values (int8), request by request, in the mix's shares."""
    if not is_mixed(classes):
        return np.full(n, int(Priority.STANDARD), dtype=np.int8)
    shares = np.asarray(classes.shares(), dtype=np.float64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed)).spawn(3)[2]))
    return rng.choice(len(Priority), size=n, p=shares / shares.sum()).astype(np.int8)


def is_mixed(classes: ClassMix) -> bool:
    """Any request not standard (then results are reported per class)."""
    return classes.standard != 1.0


def class_headers(priority: Priority) -> dict[str, str]:
    """The request header that asks for ``priority``."""
    return {OBJECTIVE_HEADER: priority.name.lower()}
