"""A filter and a scorer written as in docs/policies.md, plugged into the live chain: real Envoy, control plane
and ext_proc, simulated workers.

The plugins are the guide's own code blocks (read from docs/policies.md, written to a module the test allows in
both services), so the guide cannot drift from what works. Where each request went is read from the
``x-inferlb-endpoint`` response header (ext_proc's pick).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import ROOT
from .stack import ControlPlane, http, running_gateway, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

MODULE = "readme_pick_plugins"
REQUESTS = 30


def readme_plugins() -> str:
    """docs/policies.md's Python blocks that define a pick filter and a pick scorer, as one module."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "policies.md").read_text(), re.S)
    chosen = [b for b in blocks if 'kind = "filter"' in b] + [b for b in blocks if 'kind = "scorer"' in b]
    assert len(chosen) == 2, "docs/policies.md shows one pick filter and one pick scorer"
    for block in chosen:
        assert len(block.strip().splitlines()) < 30, "each example in docs/policies.md stays under 30 lines"
    return "\n\n".join(chosen)


def admin(cp: ControlPlane, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    with http() as client:
        return client.request(method, f"{cp.admin_url}{path}", json=body,
                              headers={"authorization": f"Bearer {cp.admin_token()}"})


def test_a_readme_filter_and_scorer_steer_live_picks(tmp_path: Path) -> None:
    package = tmp_path / "plugins"
    package.mkdir()
    (package / f"{MODULE}.py").write_text(readme_plugins())
    allow = {"INFERLB_CP_ALLOWED_POLICY_MODULES": MODULE, "INFERLB_EXT_PROC_ALLOWED_POLICY_MODULES": MODULE,
             "PYTHONPATH": str(package)}
    with running_gateway(tmp_path, workers=3, name="plugins", cp_env=allow, ext_proc_env=allow) as gw:
        cp, ext_proc, procs, ids = gw.cp, gw.ext_proc, gw.procs, gw.ids
        quarantined, heavy, light = (w.id for w in gw.workers)

        def picks() -> list[str | None]:
            with http() as client:
                responses = [client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings",
                                         json={"input": f"request {i}"}, timeout=30) for i in range(REQUESTS)]
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
            return [r.headers.get("x-inferlb-endpoint") for r in responses]

        wait_for(lambda: set(picks()) == ids, 30, "the default chain to pick every worker", procs)
        for endpoint, weight in ((heavy, 1000), (light, 1)):
            assert admin(cp, "PUT", f"/v1/endpoints/{endpoint}/weight", {"weight": weight}).status_code == 200
        chain = {"name": "least_completion_time", "params": {
            "filters": [{"plugin": f"{MODULE}:Quarantine", "params": {"endpoints": [quarantined]}}],
            "scorers": [{"plugin": f"{MODULE}:PreferHeavy", "weight": 100}]}}
        response = admin(cp, "PUT", "/v1/policy", {"pick": chain})
        assert response.status_code == 200, response.text
        switched = lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_policy_switches_total",  # noqa: E731
                                  result="switched") == 1
        wait_for(switched, 30, "ext_proc to switch to the chain with the README's plugins", procs)
        # The filter keeps the quarantined worker out; the scorer, weighted 100 against the default
        # scorer's 1, sends everything to the worker pinned heaviest.
        wait_for(lambda: set(picks()) == {heavy}, 30, "every pick to go to the heaviest worker", procs)
        assert not any(v for (name, _), v in ext_proc.metrics().items()
                       if name == "inferlb_ext_proc_policy_failures_total")
        # Without the scorer, the filter alone: the two others share the work, the quarantined one gets none.
        response = admin(cp, "PUT", "/v1/policy", {"pick": {"name": "least_completion_time", "params": {
            "filters": chain["params"]["filters"]}}})  # type: ignore[index]
        assert response.status_code == 200, response.text
        wait_for(lambda: set(picks()) == {heavy, light}, 30, "the two workers left to share the picks", procs)
