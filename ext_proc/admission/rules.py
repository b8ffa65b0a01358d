"""How admission measures room and wait: the settings of the door, and the fleet's rate they are read with.

Kept apart from the admission stage so that the simulator can use the same rules (issue 37: one code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..model import SIZE_BOUNDS, size_bucket

# The request size the fleet's rate is read at (tokens): a typical embeddings request's.
RATE_PROBE_TOKENS = 256


@dataclass(frozen=True)
class AdmissionRules:
    """``room``: "requests" (``depth`` in flight per routable endpoint, the old rule) or "work" (the
    predicted seconds already sent, per routable endpoint, stay under ``budget_s``, and an idle endpoint
    always takes one). ``flows``: callers without a key wait as one flow per client "address" (Envoy's
    ``source.address``), per value of a trusted proxy's ``flow_header`` ("header": its last entry), or as
    "one" flow. ``early_refusal``: a request whose predicted wait exceeds its maximum is refused at once."""

    depth: int = 0
    room: Literal["requests", "work"] = "work"
    budget_s: float = 0.5
    flows: Literal["address", "header", "one"] = "address"
    flow_header: str = "x-forwarded-for"
    early_refusal: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ValueError(f"budget_s must be a positive number, got {self.budget_s}")


def size_label(tokens: int) -> str:
    """The admission-wait metric's size label: le_64, le_512, le_4096, gt_4096."""
    bucket = size_bucket(tokens)
    return f"le_{SIZE_BOUNDS[bucket]}" if bucket < len(SIZE_BOUNDS) else f"gt_{SIZE_BOUNDS[-1]}"
