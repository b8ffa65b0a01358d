"""Map the control plane's weights (1..1000) onto a few integer nginx weights, with hysteresis.

Every nginx reload starts fresh worker processes and resets their balancing
state, so a reload must be worth it: weights are scaled to 1..``levels``
relative to the heaviest endpoint, and a level only moves once the raw value
is more than ``hysteresis`` of a level beyond the rounding edge. Telemetry
noise then changes no bytes, and unchanged bytes never reload.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping


def quantise(weights: Mapping[str, int], levels: int, *, previous: Mapping[str, int] | None = None,
             hysteresis: float = 0.0, exact: Collection[str] = ()) -> dict[str, int]:
    """endpoint id -> level in 1..``levels``; endpoints weighing 0 or less are left out (the caller marks them down).

    ``previous``: the levels nginx runs now; an endpoint keeps its level while its raw value stays within
    0.5 + ``hysteresis`` of it. Ids in ``exact`` (pinned by an operator: deliberate, not noise) skip the
    hysteresis. Pure and deterministic: the same inputs give the same levels.
    """
    if levels < 1:
        raise ValueError(f"levels must be at least 1, not {levels}")
    positive = {k: w for k, w in weights.items() if w > 0}
    if not positive:
        return {}
    top = max(positive.values())
    previous = previous or {}
    out: dict[str, int] = {}
    for endpoint_id, weight in positive.items():
        raw = weight * levels / top
        level = min(levels, max(1, math.floor(raw + 0.5)))  # half up, not banker's rounding
        held = previous.get(endpoint_id)
        if held is not None and endpoint_id not in exact and abs(raw - held) <= 0.5 + hysteresis:
            level = min(levels, max(1, held))
        out[endpoint_id] = level
    return out
