"""What a worker serves, learned from its /metrics (issue 15): the info metrics' parser, and the real
Scraper over real HTTP keeping each endpoint's models, aliases and pool (through failed scrapes too)."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette

from control_plane.model import Endpoint, Health
from control_plane.telemetry.scraper import ScrapeFailed, ScrapeOk, Scraper, apply_scrape_results
from control_plane.telemetry.served_models import MAX_ALIASES, MAX_MODELS, ServedModels, read_served_models
from control_plane.telemetry.parse import parse_families
from inferlb_runtime.model_routing import DEFAULT_POOL

from .conftest import free_port
from .test_scraper import metrics_app, run, serving
from .test_telemetry import FakeWorkerMetrics

FAMILY = "all-MiniLM-L6-v2"
ALIASES = f"{FAMILY},sentence-transformers/{FAMILY}"
GOOD = f"""\
# HELP inferlb_worker_model_info The model versions this worker serves (value 1).
# TYPE inferlb_worker_model_info gauge
inferlb_worker_model_info{{model="{FAMILY}-int8",family="{FAMILY}",aliases="{ALIASES}"}} 1
inferlb_worker_model_info{{model="{FAMILY}-fp32",family="{FAMILY}",aliases="{ALIASES}"}} 1
# HELP inferlb_worker_pool_info The pool this worker belongs to (value 1).
# TYPE inferlb_worker_pool_info gauge
inferlb_worker_pool_info{{pool="minilm"}} 1
"""


MODEL_TYPE = "# TYPE inferlb_worker_model_info gauge\n"
POOL_TYPE = "# TYPE inferlb_worker_pool_info gauge\n"


def served(text: str) -> tuple[ServedModels, tuple[str, ...]]:
    reading = read_served_models(parse_families(text))
    return reading.served, reading.problems


class ModelWorkerMetrics(FakeWorkerMetrics):
    """A worker's /metrics (simulated) followed by info lines the test sets."""

    def __init__(self, info: str) -> None:
        super().__init__()
        self.info = info

    def text(self) -> str:
        return super().text() + self.info


# --- the parser ------------------------------------------------------------------------------------------


def test_versions_sorted_aliases_and_families_merged_and_the_pool() -> None:
    got, problems = served(GOOD)
    assert got == ServedModels(models=(f"{FAMILY}-fp32", f"{FAMILY}-int8"),
                               aliases=(FAMILY, f"sentence-transformers/{FAMILY}"), pool="minilm")
    assert problems == ()


def test_a_worker_without_the_info_metrics_serves_no_declared_model_in_the_default_pool() -> None:
    got, problems = served(FakeWorkerMetrics().text())
    assert got == ServedModels((), (), DEFAULT_POOL) and problems == ()


def test_a_family_alone_or_an_empty_aliases_label_is_fine() -> None:
    got, problems = served(MODEL_TYPE + 'inferlb_worker_model_info{model="m-v2",family="m",aliases=""} 1\n'
                           'inferlb_worker_model_info{model="other"} 1\n')
    assert got == ServedModels(("m-v2", "other"), ("m",), DEFAULT_POOL) and problems == ()


def test_malformed_names_are_left_out_and_reported_never_raised() -> None:
    text = (
        MODEL_TYPE + 'inferlb_worker_model_info{model="good-v1",family="good",aliases="ok,bad alias, ,-dash"} 1\n'
        'inferlb_worker_model_info{model="bad model",family="x"} 1\n'  # the whole version is left out
        'inferlb_worker_model_info{family="nameless"} 1\n'
        f'inferlb_worker_model_info{{model="{"l" * 129}"}} 1\n'
        'inferlb_worker_model_info{model="switched-off"} 0\n'  # not served
        'inferlb_worker_model_info{model="nan"} NaN\n'
        + POOL_TYPE + 'inferlb_worker_pool_info{pool="Bad_Pool"} 1\n'
    )
    got, problems = served(text)
    assert got == ServedModels(("good-v1",), ("good", "ok"), DEFAULT_POOL)
    joined = "\n".join(problems)
    for fragment in ("'bad alias'", "'-dash'", "'bad model'", "model ''", "'Bad_Pool'", "l" * 129):
        assert fragment in joined, (fragment, problems)


def test_several_pools_take_the_first_in_sort_order_and_say_so() -> None:
    got, problems = served(POOL_TYPE + 'inferlb_worker_pool_info{pool="zeta"} 1\n'
                                       'inferlb_worker_pool_info{pool="alpha"} 1\n')
    assert got.pool == "alpha" and any("several pools" in p for p in problems)


def test_a_worker_declaring_too_many_names_is_capped_and_reported() -> None:
    lines = "".join(f'inferlb_worker_model_info{{model="m{i:03d}",aliases="a{i:03d}-1,a{i:03d}-2,a{i:03d}-3,'
                    f'a{i:03d}-4,a{i:03d}-5"}} 1\n' for i in range(MAX_MODELS + 10))
    got, problems = served(MODEL_TYPE + lines)
    assert got.models == tuple(f"m{i:03d}" for i in range(MAX_MODELS))
    assert len(got.aliases) == MAX_ALIASES and got.aliases == tuple(sorted(got.aliases))
    assert any(f"{MAX_MODELS + 10} models" in p for p in problems)
    assert any("aliases: keeping the first" in p for p in problems)


# --- folding into the endpoints ---------------------------------------------------------------------------


def test_what_an_endpoint_serves_survives_failed_scrapes_and_follows_the_worker() -> None:
    first = ServedModels(("m-v1",), ("m",), "p1")
    e = Endpoint("10.0.0.1", 1)
    (e,) = apply_scrape_results((e,), {e.id: ScrapeOk(at=1.0, duration_s=0.01, telemetry=None, served=first)})
    assert (e.models, e.model_aliases, e.pool) == (("m-v1",), ("m",), "p1")
    for _ in range(3):
        (e,) = apply_scrape_results((e,), {e.id: ScrapeFailed(at=2.0, duration_s=0.01, error="down")})
    assert e.health is Health.UNHEALTHY and (e.models, e.model_aliases, e.pool) == (("m-v1",), ("m",), "p1")
    (same,) = apply_scrape_results((e,), {e.id: ScrapeOk(at=3.0, duration_s=0.01, telemetry=None)})
    assert same.models == ("m-v1",)  # a result that read nothing about models changes none
    second = ServedModels(("m-v2",), ("m",), DEFAULT_POOL)
    (e,) = apply_scrape_results((e,), {e.id: ScrapeOk(at=4.0, duration_s=0.01, telemetry=None, served=second)})
    assert (e.models, e.pool, e.health) == (("m-v2",), DEFAULT_POOL, Health.HEALTHY)


# --- the real scraper over HTTP -----------------------------------------------------------------------------


@pytest.mark.servers
def test_the_scraper_reads_the_catalogue_over_http_and_logs_bad_names_once(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ModelWorkerMetrics(GOOD)

    async def main() -> None:
        port = free_port()
        endpoint = Endpoint("127.0.0.1", port)
        app: Starlette = metrics_app(metrics)
        scraper = Scraper()
        async with scraper.make_client() as client:
            async with serving(app, port):
                results = await scraper.scrape_once(client, (endpoint,))
                (endpoint,) = apply_scrape_results((endpoint,), results)
                assert endpoint.models == (f"{FAMILY}-fp32", f"{FAMILY}-int8") and endpoint.pool == "minilm"
                assert endpoint.model_aliases == (FAMILY, f"sentence-transformers/{FAMILY}")

                metrics.info = (MODEL_TYPE + 'inferlb_worker_model_info{model="m v2"} 1\n'
                                'inferlb_worker_model_info{model="m-v3"} 1\n')
                with caplog.at_level(logging.WARNING, logger="control_plane.telemetry.scraper"):
                    for _ in range(2):
                        results = await scraper.scrape_once(client, (endpoint,))
                        assert isinstance(results[endpoint.id], ScrapeOk)  # a bad name fails no scrape
                        (endpoint,) = apply_scrape_results((endpoint,), results)
                assert (endpoint.models, endpoint.model_aliases, endpoint.pool) == (("m-v3",), (), DEFAULT_POOL)
                warnings = [r for r in caplog.records if "invalid model or pool names" in r.getMessage()]
                assert len(warnings) == 1 and "'m v2'" in str(getattr(warnings[0], "problems"))
            results = await scraper.scrape_once(client, (endpoint,))  # the server is gone
            assert isinstance(results[endpoint.id], ScrapeFailed)
            (endpoint,) = apply_scrape_results((endpoint,), results)
            assert endpoint.models == ("m-v3",)

    run(main)
