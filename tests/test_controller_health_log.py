"""The controller's log of endpoint health changes: a return to healthy is good news (INFO), a change to
anything else needs a look (WARNING). No servers: scrape rounds are folded in directly."""

from __future__ import annotations

import logging
import time

import pytest

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.model import Telemetry
from control_plane.telemetry.scraper import ScrapeFailed, ScrapeOk
from control_plane.xds import SnapshotCache

ENDPOINT = "127.0.0.1:9001"


def ok() -> dict[str, ScrapeOk]:
    now = time.monotonic()
    return {ENDPOINT: ScrapeOk(now, 0.01, Telemetry(observed_at=now, rps=1.0))}


def failed() -> dict[str, ScrapeFailed]:
    return {ENDPOINT: ScrapeFailed(time.monotonic(), 0.01, "ConnectError")}


def health_changes(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.__dict__["health"]) for r in caplog.records if r.getMessage() == "endpoint health changed"]


def test_healthy_is_info_and_unhealthy_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    controller = Controller(ControlPlaneConfig(endpoints=[ENDPOINT], unhealthy_after=1), SnapshotCache())
    with caplog.at_level(logging.INFO, logger="inferlb.control_plane"):
        controller.on_scrape_results(ok())  # unknown -> healthy
        controller.on_scrape_results(failed())  # healthy -> unhealthy
        controller.on_scrape_results(ok())  # unhealthy -> healthy
    assert health_changes(caplog) == [(logging.INFO, "healthy"), (logging.WARNING, "unhealthy"),
                                      (logging.INFO, "healthy")]
