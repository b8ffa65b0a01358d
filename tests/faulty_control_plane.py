"""``python -m tests.faulty_control_plane ...``: the real control plane, whose publishing fails on demand.

Nothing a client can send makes publishing fail today, so the fault is
injected: while the file named by ``INFERLB_TEST_PUBLISH_FAULT`` exists,
building the Envoys' snapshot raises. Everything else (the debounced
publisher, xDS, the admin API, ``/readyz``, ``/metrics``) is the real
process with its real command line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from control_plane import controller
from control_plane.__main__ import main

FAULT_ENV = "INFERLB_TEST_PUBLISH_FAULT"


def inject(flag: Path) -> None:
    build = controller.build_snapshot

    def build_snapshot(*args: Any, **kwargs: Any) -> Any:
        if flag.exists():
            raise RuntimeError(f"injected publish fault ({flag} exists)")
        return build(*args, **kwargs)

    controller.build_snapshot = build_snapshot  # type: ignore[assignment]


if __name__ == "__main__":
    inject(Path(os.environ[FAULT_ENV]))
    raise SystemExit(main())
