"""Correctness of the ONNX conversion, the tokenizer set-up, the engine and the model cache.

The reference embeddings come from the Hugging Face implementation (PyTorch,
fp32); see tests/fixtures/minilm_reference.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from workers import model_store
from workers.engine import Engine
from workers.model_files import BertConfig, PackagedModel
from workers.model_store import ModelArtifacts, prepare_models
from workers.onnx_graph import LINEAR_INPUTS, Int8Prep, build_embedding_graph, plan_int8
from workers.tokenization import encode_texts, load_tokenizer

def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# `reference` and `data_dir` ($INFERLB_DATA_DIR, which the Makefile exports, else a
# temporary directory) come from conftest.py.


@pytest.fixture(scope="session")
def artifacts(data_dir: Path) -> ModelArtifacts:
    return prepare_models(data_dir)


@pytest.fixture(scope="session")
def reference_ids(artifacts: ModelArtifacts, reference: dict) -> list[list[int]]:
    tokenizer = load_tokenizer(artifacts.tokenizer, artifacts.max_tokens)
    return encode_texts(tokenizer, [item["text"] for item in reference["items"]])


@pytest.fixture(scope="session")
def fp32_engine(artifacts: ModelArtifacts) -> Engine:
    return Engine(artifacts.fp32)


@pytest.fixture(scope="session")
def int8_engine(artifacts: ModelArtifacts) -> Engine:
    return Engine(artifacts.int8)


# --- the real model against the reference -------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_token_counts_match_reference(reference: dict, reference_ids: list[list[int]]) -> None:
    assert [len(ids) for ids in reference_ids] == [item["tokens_with_special"] for item in reference["items"]]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(("engine_name", "threshold"), [("fp32_engine", 0.9999), ("int8_engine", 0.99)])
def test_embeddings_match_reference(
    request: pytest.FixtureRequest, engine_name: str, threshold: float, reference: dict, reference_ids: list[list[int]]
) -> None:
    engine: Engine = request.getfixturevalue(engine_name)
    assert engine.dimensions == 384
    for item, ids in zip(reference["items"], reference_ids, strict=True):
        (embedding,) = engine.embed([ids])
        assert embedding.dtype == np.float32
        assert cosine(embedding, np.asarray(item["embedding"])) >= threshold, item["text"][:40]


@pytest.mark.model
@pytest.mark.slow
def test_padding_does_not_change_embeddings(fp32_engine: Engine, reference_ids: list[list[int]]) -> None:
    together = fp32_engine.embed(reference_ids)
    alone = np.vstack([fp32_engine.embed([ids]) for ids in reference_ids])
    assert together.shape == (len(reference_ids), fp32_engine.dimensions)
    assert np.abs(together - alone).max() < 1e-5


@pytest.mark.model
@pytest.mark.slow
def test_int8_in_a_mixed_batch_still_matches_reference(
    int8_engine: Engine, reference: dict, reference_ids: list[list[int]]
) -> None:
    # Dynamic int8 picks activation scales per batch, so batch mates shift results a little.
    together = int8_engine.embed(reference_ids)
    for item, embedding in zip(reference["items"], together, strict=True):
        assert cosine(embedding, np.asarray(item["embedding"])) >= 0.99, item["text"][:40]


@pytest.mark.model
@pytest.mark.slow
def test_long_text_truncates_to_max_tokens(artifacts: ModelArtifacts, fp32_engine: Engine) -> None:
    tokenizer = load_tokenizer(artifacts.tokenizer, artifacts.max_tokens)
    (ids,) = encode_texts(tokenizer, ["load balancing " * 400])
    assert len(ids) == 256
    assert ids[0] == tokenizer.token_to_id("[CLS]") and ids[-1] == tokenizer.token_to_id("[SEP]")
    assert fp32_engine.embed([ids]).shape == (1, 384)


@pytest.mark.model
@pytest.mark.slow
def test_engine_rejects_bad_input(fp32_engine: Engine) -> None:
    assert fp32_engine.embed([]).shape == (0, 384)
    with pytest.raises(ValueError):
        fp32_engine.embed([[]])
    with pytest.raises(ValueError):
        fp32_engine.embed([[101, 30522, 102]])
    with pytest.raises(ValueError):
        fp32_engine.embed([[101] * 513])


@pytest.mark.model
@pytest.mark.slow
def test_second_prepare_reuses_cache(artifacts: ModelArtifacts) -> None:
    data_dir = artifacts.fp32.parents[3]
    paths = (artifacts.fp32, artifacts.int8, artifacts.tokenizer)
    before = [p.stat().st_mtime_ns for p in paths]
    messages: list[str] = []
    again = prepare_models(data_dir, progress=messages.append)
    assert again == artifacts
    assert [p.stat().st_mtime_ns for p in paths] == before
    assert messages == []


# --- the graph against a numpy forward pass, on a tiny random BERT ---------------------------

TINY = BertConfig(
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    intermediate_size=16,
    layer_norm_eps=1e-12,
    vocab_size=20,
    max_position_embeddings=16,
    type_vocab_size=2,
)


def tiny_weights(config: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, size=shape).astype(np.float32)

    h, f = config.hidden_size, config.intermediate_size
    w = {
        "embeddings.word_embeddings.weight": rand(config.vocab_size, h),
        "embeddings.position_embeddings.weight": rand(config.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": rand(config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": 1.0 + rand(h),
        "embeddings.LayerNorm.bias": rand(h),
    }
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        for name, (out_dim, in_dim) in {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (f, h),
            "output.dense": (h, f),
        }.items():
            w[f"{p}.{name}.weight"] = rand(out_dim, in_dim)
            w[f"{p}.{name}.bias"] = rand(out_dim)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"{p}.{ln}.weight"] = 1.0 + rand(h)
            w[f"{p}.{ln}.bias"] = rand(h)
    return w


def numpy_embedding(ids: list[int], w: Mapping[str, np.ndarray], config: BertConfig) -> np.ndarray:
    """BERT + mean pooling + L2 normalisation for one unpadded sequence, in float64."""
    w64 = {k: v.astype(np.float64) for k, v in w.items()}

    def layer_norm(x: np.ndarray, prefix: str) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + config.layer_norm_eps) * w64[f"{prefix}.weight"] + w64[f"{prefix}.bias"]

    def linear(x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ w64[f"{prefix}.weight"].T + w64[f"{prefix}.bias"]

    n, heads, d = len(ids), config.num_heads, config.head_size
    x = (
        w64["embeddings.word_embeddings.weight"][ids]
        + w64["embeddings.position_embeddings.weight"][:n]
        + w64["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, "embeddings.LayerNorm")
    erf = np.vectorize(math.erf)
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        q, k, v = (
            linear(x, f"{p}.attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
            for m in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(1, 0, 2).reshape(n, heads * d)
        x = layer_norm(x + linear(context, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
        h = linear(x, f"{p}.intermediate.dense")
        h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
        x = layer_norm(x + linear(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
    pooled = x.mean(0)
    return pooled / max(np.linalg.norm(pooled), 1e-12)


def test_graph_matches_numpy_reference_with_padding() -> None:
    w = tiny_weights(TINY)
    model = build_embedding_graph(w, TINY)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    items = [[1, 5, 7, 3], [2, 4, 6, 8, 9, 1, 19], [0], [11, 12]]
    longest = max(map(len, items))
    input_ids = np.zeros((len(items), longest), dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    for row, item in enumerate(items):
        input_ids[row, : len(item)] = item
        attention_mask[row, : len(item)] = 1
    (got,) = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})
    assert got.shape == (len(items), TINY.hidden_size) and got.dtype == np.float32
    expected = np.vstack([numpy_embedding(item, w, TINY) for item in items])
    np.testing.assert_allclose(got, expected, atol=1e-5)


def width(group: str) -> int:
    """Channels at the input of a group of TINY's weight MatMuls."""
    return TINY.intermediate_size if group == "ffn_out" else TINY.hidden_size


def test_int8_rewrites_leave_the_fp32_result_unchanged() -> None:
    # Smoothing (all four groups, including the free one folded into v) and the fp32
    # outlier-channel path are exact rewrites; only quantisation may change results.
    w = tiny_weights(TINY)
    rng = np.random.default_rng(1)
    prep = Int8Prep(
        smoothing={
            (layer, group): rng.uniform(0.2, 5.0, size=width(group)).astype(np.float32)
            for layer in range(TINY.num_layers)
            for group in LINEAR_INPUTS
        },
        fp32_ffn_channels={0: [3, 11], 1: [7]},
    )
    plain = ort.InferenceSession(
        build_embedding_graph(w, TINY).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    rewritten = ort.InferenceSession(
        build_embedding_graph(w, TINY, prep).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    input_ids = np.array([[1, 5, 7, 3, 9], [2, 4, 0, 0, 0]], dtype=np.int64)
    attention_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=np.int64)
    feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
    np.testing.assert_allclose(rewritten.run(None, feeds)[0], plain.run(None, feeds)[0], atol=1e-5)


def test_plan_int8_smooths_and_isolates_outlier_channels() -> None:
    w = tiny_weights(TINY)
    absmax = {
        (layer, group): np.ones(width(group), np.float32)
        for layer in range(TINY.num_layers)
        for group in LINEAR_INPUTS
    }
    absmax[(1, "ffn_out")][5] = 40.0  # one GELU channel far above the rest
    prep = plan_int8(w, TINY, absmax)
    assert prep.fp32_ffn_channels == {1: [5]}
    smoothed_groups = ("qkv", "attn_out", "ffn_in")
    assert set(prep.smoothing) == {(layer, g) for layer in range(TINY.num_layers) for g in smoothed_groups}
    assert all(s.shape == (TINY.hidden_size,) and (s > 0).all() for s in prep.smoothing.values())


# --- the cache, on a tiny model so that builds take milliseconds -------------------------------


def tiny_tokenizer() -> Tokenizer:
    """A word-level tokenizer over TINY's vocabulary, with [CLS]/[SEP] like the real one."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "a", "is", "of", "and", "to", "in", "on", "for", "with"]
    vocab = {word: index for index, word in enumerate(words[: TINY.vocab_size])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return tokenizer


@pytest.fixture
def tiny_source(tmp_path: Path) -> PackagedModel:
    directory = tmp_path / "package"
    directory.mkdir()
    source = PackagedModel(
        directory=directory,
        weights=directory / "model.safetensors",
        tokenizer=directory / "tokenizer.json",
        config=directory / "config.json",
    )
    save_file(tiny_weights(TINY), str(source.weights))
    tiny_tokenizer().save(str(source.tokenizer))  # prepare_models calibrates int8 on tokenized texts
    source.config.write_text(
        json.dumps(
            {
                "hidden_size": TINY.hidden_size,
                "num_hidden_layers": TINY.num_layers,
                "num_attention_heads": TINY.num_heads,
                "intermediate_size": TINY.intermediate_size,
                "layer_norm_eps": TINY.layer_norm_eps,
                "vocab_size": TINY.vocab_size,
                "max_position_embeddings": TINY.max_position_embeddings,
                "type_vocab_size": TINY.type_vocab_size,
                "hidden_act": "gelu",
            }
        )
    )
    return source


def test_crash_mid_build_is_not_trusted(
    tmp_path: Path, tiny_source: PackagedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"

    def crash(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt  # stands in for a kill during quantisation

    monkeypatch.setattr(model_store, "quantize_dynamic", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_models(data_dir, source=tiny_source)
    monkeypatch.undo()

    leftovers = [p.name for p in data_dir.rglob("*") if p.is_file()]
    assert "manifest.json" not in leftovers and "model.int8.onnx" not in leftovers
    assert not [name for name in leftovers if name.endswith(".tmp")]

    messages: list[str] = []
    built = prepare_models(data_dir, source=tiny_source, progress=messages.append)
    assert any("building" in m for m in messages)
    assert built.dimensions == TINY.hidden_size
    assert Engine(built.int8).embed([[1, 2, 3]]).shape == (1, TINY.hidden_size)

    # A file that no longer matches the manifest (truncated, say) forces a rebuild.
    built.int8.write_bytes(built.int8.read_bytes()[:100])
    messages.clear()
    rebuilt = prepare_models(data_dir, source=tiny_source, progress=messages.append)
    assert rebuilt == built and any("building" in m for m in messages)
    assert Engine(rebuilt.int8).embed([[1, 2, 3]]).shape == (1, TINY.hidden_size)


def test_new_weights_get_a_new_cache_directory(tmp_path: Path, tiny_source: PackagedModel) -> None:
    first = prepare_models(tmp_path, source=tiny_source)
    save_file(tiny_weights(TINY, seed=1), str(tiny_source.weights))
    second = prepare_models(tmp_path, source=tiny_source)
    assert first.fp32.parent != second.fp32.parent
    assert first.fp32.is_file() and second.fp32.is_file()
