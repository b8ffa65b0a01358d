"""grpc's settings for ext_proc, applied before grpc loads (it reads them once, at import).

Without its EventEngine listener and endpoints, grpc 1.85's aio server hands
each message between fewer threads: ~26 context switches per ext_proc
stream instead of ~43, and 1.2-1.7x the streams per CPU-second
(docs/benchmarks.md section 3). ``python -m ext_proc`` applies it, and so
does the ext_proc bench's trivial servicer, whose floor must run on the same
grpc as ext_proc. Set GRPC_EXPERIMENTS (even to "") to choose otherwise.
"""

from __future__ import annotations

import os

GRPC_EXPERIMENTS_DEFAULT = "-event_engine_listener,-event_engine_for_all_other_endpoints"


def use_grpc_defaults() -> None:
    """Set GRPC_EXPERIMENTS to ours unless it is set. Call it before grpc loads: later it changes nothing."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)
