"""Jittered exponential backoff, for anything that retries a failing step.

Retry ``n`` waits a random time between half the ceiling and the ceiling,
where the ceiling doubles from ``initial_s`` up to ``max_s``: the lower half
keeps a broken dependency from being hammered, the random half keeps many
replicas from retrying in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds before retry number ``attempt`` (1 = the first retry); never 0, never above ``max_s``."""
        ceiling = min(self.max_s, self.initial_s * 2 ** min(max(0, attempt - 1), 64))
        return max(self.initial_s / 2, (rng or random).uniform(ceiling / 2, ceiling))
