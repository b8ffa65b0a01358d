"""A real worker process over real HTTP: correctness, bad input, telemetry, concurrency."""

from __future__ import annotations

import asyncio
import base64
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workers.model_store import prepare_models
from workers.tokenization import load_tokenizer

from .conftest import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.model]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def post(worker: WorkerProcess, body: object | bytes, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    if isinstance(body, bytes):
        return httpx.post(f"{worker.url}/v1/embeddings", content=body, timeout=60, **kw)
    return httpx.post(f"{worker.url}/v1/embeddings", json=body, timeout=60, **kw)


def metrics(worker: WorkerProcess) -> dict[str, float]:
    """Flatten the worker's exposition into ``{sample_name{labels}: value}``."""
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_embeddings_match_the_reference(worker: WorkerProcess, reference: dict) -> None:
    items = reference["items"]
    response = post(worker, {"model": "all-MiniLM-L6-v2", "input": [it["text"] for it in items]})
    assert response.status_code == 200, response.text
    doc = response.json()
    # The version that served, named in the body and the header: the worker's one version (int8 by default).
    assert doc["object"] == "list" and doc["model"] == "all-MiniLM-L6-v2-int8"
    assert response.headers["x-inferlb-model"] == "all-MiniLM-L6-v2-int8"
    assert [d["index"] for d in doc["data"]] == list(range(len(items)))
    for item, data in zip(items, doc["data"]):
        assert len(data["embedding"]) == 384
        assert cosine(np.array(data["embedding"]), np.array(item["embedding"])) >= 0.99, item["text"][:40]
    expected_tokens = sum(it["tokens_with_special"] for it in items)
    assert doc["usage"] == {"prompt_tokens": expected_tokens, "total_tokens": expected_tokens}
    assert response.headers["x-inferlb-tokens"] == str(expected_tokens)


def test_alias_single_string_base64_and_token_arrays_agree(
    worker: WorkerProcess, reference: dict, data_dir: Path
) -> None:
    item = reference["items"][0]
    by_text = post(worker, {"model": "sentence-transformers/all-MiniLM-L6-v2", "input": item["text"]}).json()
    by_b64 = post(worker, {"input": item["text"], "encoding_format": "base64"}).json()
    vector = np.array(by_text["data"][0]["embedding"], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(by_b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vector, rtol=1e-6, atol=1e-7)
    # The same text as the token ids the tokenizer gives ([CLS] ... [SEP]): the same embedding.
    ids = load_tokenizer(prepare_models(data_dir).tokenizer).encode(item["text"]).ids
    assert len(ids) == item["tokens_with_special"]
    for body in ({"input": ids}, {"input": [ids, ids]}):
        doc = post(worker, body).json()
        assert doc["usage"]["prompt_tokens"] == len(ids) * len(doc["data"])
        for data in doc["data"]:
            np.testing.assert_allclose(data["embedding"], vector, atol=1e-5)


def test_long_input_truncates_to_256_tokens_or_is_refused(worker: WorkerProcess, reference: dict) -> None:
    long_items = [it for it in reference["items"] if it["tokens_with_special"] == 256]
    text = long_items[0]["text"] if long_items else "word " * 400
    ok = post(worker, {"input": text})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    refused = post(worker, {"input": text, "truncate": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    ids = [101] + [2000] * 300 + [102]
    assert post(worker, {"input": ids}).json()["usage"]["prompt_tokens"] == 256
    too_long = post(worker, {"input": ids, "truncate": False}).json()["error"]
    assert "302 tokens" in too_long["message"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"this is not json", 400, "invalid_json"),
        (b'{"input": {"text": "x"}}', 400, "invalid_value"),
        (b'{"model": "all-MiniLM-L6-v2"}', 400, "missing_field"),
        (b'{"input": []}', 400, "empty_input"),
        (b'{"input": ["a", 3]}', 400, "invalid_value"),
        (b'{"input": [1, 99999999]}', 400, "invalid_value"),
        (b'{"input": "x", "dimensions": 128}', 400, "invalid_value"),
        (b'{"input": "x", "model": "gpt-4"}', 404, "model_not_found"),
    ],
)
def test_bad_input_gets_a_clear_error(worker: WorkerProcess, body: bytes, status: int, code: str) -> None:
    response = post(worker, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_too_many_inputs_and_oversized_bodies(worker: WorkerProcess) -> None:
    many = post(worker, {"input": ["x"] * 2049})
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_inputs"
    huge = post(worker, b'{"input": "' + b"a" * (5 * 1024 * 1024) + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    # Chunked, with no Content-Length: still cut off at the limit.
    chunks = (b"x" * 65536 for _ in range(100))
    chunked = httpx.post(f"{worker.url}/v1/embeddings", content=chunks, timeout=60)
    assert chunked.status_code == 413


def test_unknown_routes_and_methods_answer_in_openai_shape(worker: WorkerProcess) -> None:
    missing = httpx.get(f"{worker.url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(f"{worker.url}/v1/embeddings", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_the_worker_survives_bad_input(worker: WorkerProcess) -> None:
    for body in (b"\xff\xfe", b"{", b"null", b'{"input": [[]]}', b'{"input": [1.5]}', b'{"input": "x"}' * 3):
        assert post(worker, body).status_code == 400
    assert worker.process.poll() is None
    assert post(worker, {"input": "still alive"}).status_code == 200


def test_models_health_and_readiness(worker: WorkerProcess) -> None:
    models = httpx.get(f"{worker.url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["all-MiniLM-L6-v2-int8"]
    assert httpx.get(f"{worker.url}/healthz", timeout=10).status_code == 200
    ready = httpx.get(f"{worker.url}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    # Ready means warm-up inference ran: its tokens are counted already.
    assert metrics(worker)["inferlb_worker_ready"] == 1


def test_metrics_and_orca_header_report_the_work(worker: WorkerProcess) -> None:
    before = metrics(worker)
    response = post(worker, {"input": ["short one", "a somewhat longer sentence to embed here"]})
    assert response.status_code == 200
    tokens = response.json()["usage"]["prompt_tokens"]
    after = metrics(worker)
    assert after["inferlb_worker_tokens_total"] - before["inferlb_worker_tokens_total"] == tokens
    assert after["inferlb_worker_inputs_total"] - before["inferlb_worker_inputs_total"] == 2
    assert after["inferlb_worker_requests_total{code=200}"] - before.get("inferlb_worker_requests_total{code=200}", 0) == 1
    for name in ("inferlb_worker_request_duration_seconds", "inferlb_worker_queue_wait_seconds",
                 "inferlb_worker_batch_compute_seconds", "inferlb_worker_batch_size",
                 "inferlb_worker_batch_tokens"):
        assert after[f"{name}_count"] > before.get(f"{name}_count", 0), name
    for name in ("inferlb_worker_queue_depth", "inferlb_worker_inflight_requests", "inferlb_worker_cpu_utilization"):
        assert name in after
    assert 0.0 <= after["inferlb_worker_cpu_utilization"] <= 1.0
    assert after["inferlb_worker_slots"] == 1  # one batch at a time: balancers count its work as one queue

    orca = response.headers["endpoint-load-metrics"]
    assert orca.startswith("TEXT ")
    fields = dict(part.strip().split("=") for part in orca[5:].split(","))
    assert set(fields) == {"cpu_utilization", "rps_fractional", "named_metrics.queue", "named_metrics.inflight"}
    assert 0.0 <= float(fields["cpu_utilization"]) <= 1.0
    assert float(fields["rps_fractional"]) >= 0
    assert int(fields["named_metrics.inflight"]) >= 1  # this request itself
    timing = response.headers["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing and "total;dur=" in timing
    # Errors carry the load report too: the balancer learns from every response.
    assert "endpoint-load-metrics" in post(worker, b"nope").headers


def test_many_parallel_clients_get_their_own_results_in_order(worker: WorkerProcess, reference: dict) -> None:
    items = reference["items"]
    expected = {it["text"]: np.array(it["embedding"]) for it in items}
    rng = random.Random(7)
    requests = [rng.sample(list(expected), k=rng.randint(1, len(expected))) for _ in range(48)]

    async def client(texts: list[str], http: httpx.AsyncClient) -> tuple[list[str], dict]:
        # no-store: the worker cache answers none of them (nor joins them), so every input is batched
        response = await http.post(f"{worker.url}/v1/embeddings", json={"input": texts},
                                   headers={"Cache-Control": "no-store"})
        assert response.status_code == 200, response.text
        return texts, response.json()

    async def main() -> list[tuple[list[str], dict]]:
        limits = httpx.Limits(max_connections=48)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(client(texts, http) for texts in requests))

    before = metrics(worker)
    for texts, doc in asyncio.run(main()):
        assert len(doc["data"]) == len(texts)
        for text, data in zip(texts, doc["data"]):
            assert cosine(np.array(data["embedding"]), expected[text]) >= 0.99
    after = metrics(worker)
    batches = after["inferlb_worker_batch_size_count"] - before["inferlb_worker_batch_size_count"]
    inputs = after["inferlb_worker_inputs_total"] - before["inferlb_worker_inputs_total"]
    assert inputs == sum(len(t) for t in requests)
    assert batches < inputs  # concurrent inputs were batched together
