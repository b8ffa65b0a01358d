"""docs/security.md states limits and names that the code defines: each figure is read out of the page and
compared with the default it describes, so the page cannot drift from the code again (issue 41: it gave 2 MiB
and 1 MiB body limits where both were 4 MiB).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from control_plane.config import DataPlaneConfig, XdsLimitsConfig
from control_plane.reserved_tenants import RESERVED_TENANTS
from ext_proc.config import ExtProcConfig
from ext_proc.metrics import MAX_TENANTS
from workers import service
from workers.config import WorkerConfig

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
MIB = 1024 * 1024
WORKER = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}


def stated(pattern: str) -> list[int]:
    """Every number the page states where ``pattern`` (a regex with one group: the digits) matches."""
    found = [int(m.group(1).replace(",", "")) for m in re.finditer(pattern, PAGE, re.DOTALL)]
    assert found, f"docs/security.md no longer says {pattern!r}"
    return found


@pytest.mark.parametrize(("pattern", "scale", "default"), [
    (r"`max_request_body_bytes`, default (\d+) MiB,\s+`INFERLB_CP_DATA_PLANE__MAX_REQUEST_BODY_BYTES`", MIB,
     DataPlaneConfig.model_fields["max_request_body_bytes"].default),
    (r"`max_body_bytes` \(default (\d+) MiB, `INFERLB_EXT_PROC_MAX_BODY_BYTES`\)", MIB,
     ExtProcConfig.model_fields["max_body_bytes"].default),
    (r"own\s+`max_body_bytes` \(default (\d+) MiB, `INFERLB_WORKER_MAX_BODY_BYTES`\)", MIB, WORKER["max_body_bytes"]),
    (r"`max_inputs`, ([\d,]+):", 1, WORKER["max_inputs"]),
    (r"`max_request_tokens` \(([\d,]+)\)", 1, WORKER["max_request_tokens"]),
    (r"body over (\d+) KiB \(over", 1024, service.INLINE_BODY_BYTES),
    (r"in a thread, beyond ([\d,]+) characters", 1, service.INLINE_TEXT_CHARS),
    (r"\| `max_request_bytes` \| (\d+) MiB \|", MIB, XdsLimitsConfig.model_fields["max_request_bytes"].default),
    (r"tenants beyond its cap of ([\d,]+)\)", 1, MAX_TENANTS),
])
def test_a_limit_the_page_states_is_the_codes_default(pattern: str, scale: int, default: int) -> None:
    assert {n * scale for n in stated(pattern)} == {default}


def test_the_listeners_body_cap_is_one_figure_for_envoy_ext_proc_and_the_worker() -> None:
    defaults = {DataPlaneConfig.model_fields["max_request_body_bytes"].default,
                ExtProcConfig.model_fields["max_body_bytes"].default, WORKER["max_body_bytes"]}
    assert {n * MIB for n in stated(r"bodies capped at (\d+) MiB by Envoy, ext_proc and the worker")} == defaults


def test_the_page_names_the_reserved_tenants() -> None:
    named = set(re.findall(r"`(\w+)`", PAGE.split("are reserved:")[0].rsplit("- Tenant names", 1)[1]))
    assert named == RESERVED_TENANTS


def test_the_page_no_longer_says_clients_are_not_authenticated() -> None:
    assert "not yet authenticated" not in PAGE
    assert not re.search(r"\((?:2|1) MiB\)", PAGE)
