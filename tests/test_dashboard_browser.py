"""The dashboard in a real browser: headless Debian chromium driven by Playwright, against the live stack
(simulated workers, the control plane, ext_proc and Envoy, all real processes on loopback).

It checks what an operator would: the page shows every endpoint; it moves when load arrives through
Envoy (the heat map and the picks column fill, from ext_proc's counters); without the token a pin is
refused in the page; with it, a pin typed in the page reaches Envoy's ``/clusters``; an API error is
shown. The page runs under its strict Content-Security-Policy, and nothing may be logged to the
console as an error (a CSP violation, a failed script). Every wait is on a condition with a deadline.

Screenshots go to the test's tmp dir; with ``INFERLB_DASHBOARD_SCREENSHOTS=docs/img`` they are also
copied there as ``dashboard-*.png`` (how the ones in docs/ were made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .stack import BackgroundLoad, Envoy, http, running_gateway, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.chromium]

CHROMIUM = "/usr/bin/chromium"
WAIT_S = 30.0  # each condition's deadline
BODY = {"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat.", "A dog runs in the park today."]}

try:
    from playwright import sync_api
except ImportError:  # the chromium marker's check says so (skipped, or failed under make test): tests/conftest.py
    sync_api = None


def envoy_weights(envoy: Envoy) -> dict[str, int]:
    """``host:port`` -> weight of cluster "workers", from Envoy's admin ``/clusters?format=json``."""
    with http() as client:
        body = client.get(f"{envoy.admin_url}/clusters?format=json").json()
    weights = {}
    for cluster in body.get("cluster_statuses", []):
        if cluster["name"] != "workers":
            continue
        for host in cluster.get("host_statuses", []):
            address = host["address"]["socket_address"]
            weights[f"{address['address']}:{address['port_value']}"] = int(host.get("weight", 0))
    return weights


@contextmanager
def browser_page(errors: list[str], failed: list[tuple[int, str, str]]) -> Iterator[sync_api.Page]:
    """A page in headless chromium; console errors and page exceptions are appended to ``errors``, answers
    of 400 and above to ``failed`` (status, method, URL)."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # A refused request is also logged as "Failed to load resource": it is checked in ``failed``.
            page.on("console", lambda m: errors.append(m.text)
                    if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
            page.on("response", lambda r: failed.append((r.status, r.request.method, r.url)) if r.status >= 400
                    else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
        finally:
            browser.close()


def screenshot(page: sync_api.Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    out = os.environ.get("INFERLB_DASHBOARD_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


def cell(page: sync_api.Page, endpoint: str, column: str) -> str:
    return page.locator(f'#endpoints tr[data-endpoint="{endpoint}"] td[data-col="{column}"]').inner_text()


def number(text: str | None) -> float:
    try:
        return float(text or "")
    except ValueError:  # "–": not known (yet)
        return 0.0


def test_dashboard_live_in_a_browser(tmp_path: Path) -> None:
    errors: list[str] = []
    failed: list[tuple[int, str, str]] = []
    with running_gateway(tmp_path, workers=3, name="dashboard") as gw, browser_page(errors, failed) as page:
        # Conditions are polled from here, not with wait_for_function: that evaluates a string in the page,
        # which the page's CSP (no 'unsafe-eval') rightly refuses.
        def until(predicate: Callable[[], object], what: str) -> None:
            wait_for(predicate, WAIT_S, what, gw.procs)

        response = page.goto(f"{gw.cp.admin_url}/dashboard")
        assert response is not None and response.ok
        assert "script-src 'self'" in response.headers["content-security-policy"]

        # Every endpoint, in the table and in the heat map's rows; the feed is live.
        rows = page.locator("#endpoints tbody tr")
        until(lambda: rows.count() == len(gw.ids), "a row per endpoint")
        assert {rows.nth(i).get_attribute("data-endpoint") for i in range(rows.count())} == gw.ids
        assert set(page.locator("#heat-labels div").all_inner_texts()) == gw.ids
        until(lambda: page.locator("#conn").inner_text() == "live", "the live feed")
        # The xDS clients (the Envoy and the ext_proc, with acked versions) and the gateway read.
        xds = page.locator("#xds tbody")
        until(lambda: "envoy-dashboard" in xds.inner_text() and "ext-proc-dashboard" in xds.inner_text(),
              "both xDS clients listed")
        until(lambda: "1 of 1 read" in page.locator("#gateway").inner_text(), "ext_proc's /metrics read")
        heatmap = page.locator("#heatmap")
        assert number(heatmap.get_attribute("data-total")) == 0, "nothing was sent yet, so nothing was picked"

        # Load through Envoy: the heat map and every endpoint's picks column fill.
        with BackgroundLoad(gw.url(), BODY, concurrency=3, max_requests=3000, max_seconds=90) as load:
            until(lambda: number(heatmap.get_attribute("data-total")) > 0, "picks in the heat map")
            for endpoint in sorted(gw.ids):
                label = page.locator(f'#heat-labels div[data-endpoint="{endpoint}"]')
                until(lambda: number(label.get_attribute("data-total")) > 0, f"picks of {endpoint} in the heat map")
            until(lambda: any(number(cell(page, e, "picks")) > 0 for e in gw.ids), "picks/s in the table")
            until(lambda: page.locator(".chart canvas").count() >= 3, "the three charts")
            until(lambda: number(heatmap.get_attribute("data-columns")) >= 8, "a few seconds of history")
            screenshot(page, tmp_path, "under-load")

            target = sorted(gw.ids)[0]
            row = page.locator(f'#endpoints tr[data-endpoint="{target}"]')
            problems = page.locator("#problems")
            pin = 7 if envoy_weights(gw.envoy)[target] != 7 else 8  # a weight Envoy does not have yet
            # Without the token the page refuses to change anything, and says why.
            row.locator("input").fill(str(pin))
            row.get_by_role("button", name="pin", exact=True).click()
            until(lambda: "needs the admin token" in problems.inner_text(), "the page to ask for the token")
            assert envoy_weights(gw.envoy)[target] != pin

            # With the token typed once: a pin made in the page reaches Envoy.
            page.locator("#token").fill(gw.cp.admin_token())
            page.locator("#token-save").click()
            assert page.locator("#token-state").inner_text() == "token set: changes enabled"
            row.locator("input").fill(str(pin))
            row.get_by_role("button", name="pin", exact=True).click()
            until(lambda: envoy_weights(gw.envoy).get(target) == pin, f"Envoy's weight for {target} to be {pin}")
            until(lambda: cell(page, target, "pinned") == str(pin), "the pin shown in the page")
            screenshot(page, tmp_path, "pinned")

            # An API error is shown in the page (a weight out of 1..1000: 422 from the API).
            row.locator("input").fill("5000")
            row.get_by_role("button", name="pin", exact=True).click()
            until(lambda: "422" in problems.inner_text(), "the API's error in the page")
            assert envoy_weights(gw.envoy)[target] == pin
            screenshot(page, tmp_path, "error")
        assert load.snapshot().codes[200] > 0

    assert not errors, f"the page logged errors: {errors}"
    assert [(status, method) for status, method, _ in failed] == [(422, "PUT")], failed
