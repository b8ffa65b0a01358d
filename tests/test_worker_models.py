"""Several model versions per worker (issue 15): a real worker serving int8 and fp32 over real HTTP, its
config, and the catalogue's resolution rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workers.config import WorkerConfig, load_config
from workers.model_catalog import KNOWN_VERSIONS, ModelInfo, resolve_model

from .conftest import ROOT, WorkerProcess, running_worker
from .test_worker_http import cosine

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
FAMILY, HF_NAME = "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"
ALIASES = f"{FAMILY},{HF_NAME}"
TEXT = "The cat sits on the mat."


@pytest.fixture(scope="module")
def both(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One real worker serving both versions, int8 first, in pool "blue"."""
    with running_worker(data_dir, tmp_path_factory.mktemp("models"), "--models", f"{INT8},{FP32}",
                        "--pool", "blue") as w:
        yield w


def embed(worker: WorkerProcess, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/embeddings", json=body, headers=headers, timeout=60)


def served(response: httpx.Response) -> tuple[str, str]:
    """(the body's model, the x-inferlb-model header) of a 200."""
    assert response.status_code == 200, response.text
    return response.json()["model"], response.headers["x-inferlb-model"]


def vector(response: httpx.Response) -> np.ndarray:
    return np.array(response.json()["data"][0]["embedding"])


def samples(worker: WorkerProcess) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_models_lists_every_version_with_its_family_and_aliases(both: WorkerProcess) -> None:
    doc = httpx.get(f"{both.url}/v1/models", timeout=10).json()
    assert doc["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["family"], m["aliases"]) for m in doc["data"]] == [
        (INT8, "model", "inferlb", FAMILY, [FAMILY, HF_NAME]),
        (FP32, "model", "inferlb", FAMILY, [FAMILY, HF_NAME]),
    ]
    ready = httpx.get(f"{both.url}/readyz", timeout=10).json()
    assert ready == {"status": "ready", "model": INT8, "models": [INT8, FP32]}


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(("model", "expected"), [
    (INT8, INT8), (FP32, FP32),
    (FAMILY, INT8), (HF_NAME, INT8),  # an alias: the worker's first version that has it
    (None, INT8),  # no model: the first version
])
def test_the_body_model_picks_the_version_and_the_answer_names_it(
    both: WorkerProcess, model: str | None, expected: str
) -> None:
    body = {"input": TEXT} if model is None else {"input": TEXT, "model": model}
    assert served(embed(both, body)) == (expected, expected)


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_the_header_wins_over_the_body(both: WorkerProcess) -> None:
    by_header = embed(both, {"input": TEXT, "model": INT8}, {"x-inferlb-model": FP32})
    assert served(by_header) == (FP32, FP32)
    np.testing.assert_allclose(vector(by_header), vector(embed(both, {"input": TEXT, "model": FP32})), atol=1e-6)
    assert served(embed(both, {"input": TEXT}, {"x-inferlb-model": INT8})) == (INT8, INT8)


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_int8_and_fp32_are_different_models_of_the_same_meaning(both: WorkerProcess, reference: dict) -> None:
    text = reference["items"][0]["text"]
    expected = np.array(reference["items"][0]["embedding"])
    int8 = vector(embed(both, {"input": text, "model": INT8}))
    fp32 = vector(embed(both, {"input": text, "model": FP32}))
    assert not np.allclose(int8, fp32, atol=1e-4)  # two builds: quantisation moves every vector a little
    assert cosine(int8, fp32) >= 0.99 and cosine(int8, expected) >= 0.99
    assert cosine(fp32, expected) >= 0.9999  # fp32 is the reference model itself


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(("body", "headers", "param"), [
    ({"input": TEXT, "model": "gpt-4"}, {}, "model"),
    ({"input": TEXT, "model": INT8}, {"x-inferlb-model": "all-MiniLM-L12-v2"}, "x-inferlb-model"),
])
def test_a_model_this_worker_does_not_serve_is_404_saying_what_it_serves(
    both: WorkerProcess, body: dict, headers: dict[str, str], param: str
) -> None:
    response = embed(both, body, headers)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert error["param"] == param
    named = headers.get("x-inferlb-model", body["model"])
    assert f"'{named}'" in error["message"]
    assert f"it serves {INT8}, {FP32} (aliases: {FAMILY}, {HF_NAME})" in error["message"]
    assert "x-inferlb-model" not in response.headers  # no version served it


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_a_malformed_model_header_is_400(both: WorkerProcess) -> None:
    response = embed(both, {"input": TEXT}, {"x-inferlb-model": "no spaces allowed"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_header" and error["param"] == "x-inferlb-model"
    assert "x-inferlb-model" in error["message"] and "'no spaces allowed'" in error["message"]


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_metrics_say_what_the_worker_serves_and_count_per_version(both: WorkerProcess) -> None:
    before = samples(both)
    assert served(embed(both, {"input": TEXT, "model": FP32})) == (FP32, FP32)
    assert served(embed(both, {"input": [TEXT, TEXT], "model": FAMILY})) == (INT8, INT8)
    assert embed(both, {"input": TEXT, "model": "gpt-4"}).status_code == 404
    after = samples(both)
    for version in (INT8, FP32):
        assert after[("inferlb_worker_model_info", frozenset({"model": version, "family": FAMILY,
                                                              "aliases": ALIASES}.items()))] == 1
    assert after[("inferlb_worker_pool_info", frozenset({"pool": "blue"}.items()))] == 1

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after[key] - before.get(key, 0.0)

    for version in (INT8, FP32):
        assert delta("inferlb_worker_model_requests_total", model=version, code="200") == 1
        assert delta("inferlb_worker_model_request_duration_seconds_count", model=version) == 1
    # the 404 resolved to no version: the fleet-level counter has it, no per-version series does
    assert delta("inferlb_worker_requests_total", code="404") == 1
    assert not any(name == "inferlb_worker_model_requests_total" and dict(labels)["code"] == "404"
                   for name, labels in after)
    assert delta("inferlb_worker_requests_total", code="200") == 2  # the fleet-level series are unchanged
    # every input was computed or answered by the worker cache (TEXT twice in one request is computed once)
    assert sum(delta("inferlb_worker_cache_requests_total", result=result)
               for result in ("hit", "miss", "coalesced")) == 3
    assert delta("inferlb_worker_inputs_total") == delta("inferlb_worker_cache_requests_total", result="miss")


# --- config ------------------------------------------------------------------------------------------


def test_the_default_is_the_one_version_of_the_precision() -> None:
    assert WorkerConfig().served_models == (INT8,)
    assert WorkerConfig(precision="fp32").served_models == (FP32,)
    assert load_config(overrides={"precision": "fp32"}, environ={}).served_models == (FP32,)
    assert WorkerConfig(models=[FP32, INT8]).served_models == (FP32, INT8)  # models wins, in its order
    assert WorkerConfig().pool == "default"


def test_models_and_pool_come_from_toml_environment_and_flags(tmp_path: Path) -> None:
    toml = tmp_path / "worker.toml"
    toml.write_text(f'[worker]\nmodels = ["{FP32}", "{INT8}"]\npool = "canary"\n')
    from_file = load_config(toml, environ={})
    assert (from_file.models, from_file.pool) == ((FP32, INT8), "canary")
    from_env = load_config(environ={"INFERLB_WORKER_MODELS": f"{INT8}, {FP32}", "INFERLB_WORKER_POOL": "blue"})
    assert (from_env.served_models, from_env.pool) == ((INT8, FP32), "blue")
    from_flag = load_config(toml, overrides={"models": FP32}, environ={})
    assert from_flag.served_models == (FP32,)


@pytest.mark.parametrize(("values", "message"), [
    ({"models": ("all-MiniLM-L12-v2",)}, "unknown model version 'all-MiniLM-L12-v2'; known versions: "
                                         f"{INT8}, {FP32}"),
    ({"models": (INT8, INT8)}, f"models names {INT8} more than once"),
    ({"models": ("bad name",)}, "model version 'bad name' must be"),
    ({"pool": "Blue_Pool"}, "pool must be a Kubernetes name"),
    ({"pool": "-x"}, "pool must be a Kubernetes name"),
])
def test_a_bad_model_list_or_pool_is_refused_at_start_saying_why(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match="invalid worker config: .*" + message.replace("(", r"\(")):
        WorkerConfig(**values)


def test_a_models_entry_that_is_not_a_list_of_strings_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "worker.toml"
    toml.write_text("[worker]\nmodels = 3\n")
    with pytest.raises(ValueError, match="models: expected a list of strings"):
        load_config(toml, environ={})


@pytest.mark.subprocess
@pytest.mark.model
@pytest.mark.slow
def test_the_worker_exits_2_naming_an_unknown_version() -> None:
    done = subprocess.run([sys.executable, "-m", "workers", "--models", f"{INT8},nope", "--port", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown model version 'nope'" in done.stderr


# --- resolution --------------------------------------------------------------------------------------


def test_an_alias_goes_to_the_first_version_that_has_it_and_a_version_id_to_itself() -> None:
    fp32_first = [KNOWN_VERSIONS[FP32].info, KNOWN_VERSIONS[INT8].info]
    assert resolve_model(fp32_first, FAMILY).name == FP32
    assert resolve_model(fp32_first, INT8).name == INT8
    assert resolve_model(fp32_first, None).name == FP32
    assert resolve_model(fp32_first, "gpt-4") is None
    # a version id outranks an alias of the same name held by an earlier version
    odd = [ModelInfo("a", aliases=("b",)), ModelInfo("b")]
    assert resolve_model(odd, "b").name == "b"
