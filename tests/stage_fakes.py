"""Operator request stages for the tests: loaded by ext_proc (as ``tests.stage_fakes:...``) under an allowlist."""

from __future__ import annotations

from ext_proc.model import Reply, RequestView


class AlwaysRaisesFake:
    """A broken operator stage: every call raises. ext_proc must skip it, count it, and serve the request."""

    def on_request(self, request: RequestView) -> Reply | None:
        raise RuntimeError("this stage is broken on purpose")
