"""Models, versions, aliases and rollouts: the names the three services agree on.

A worker serves one or more model *versions* (``all-MiniLM-L6-v2-int8``,
``all-MiniLM-L6-v2-fp32``). Each answers to its own id and to its aliases
(its family ``all-MiniLM-L6-v2``, and ``sentence-transformers/all-MiniLM-L6-v2``);
a request naming an alias is served by the worker's first version that has it.
The worker reports what it serves in its ``/metrics`` (``inferlb_worker_model_info``),
the control plane scrapes it and publishes it per endpoint in the rich EDS
(metadata namespace ``inferlb``: :data:`MODELS_KEY`, :data:`ALIASES_KEY`,
:data:`POOL_KEY`).

A *rollout* maps an alias to versions with traffic percentages: a canary is
``{"v1": 90, "v2": 10}``, a blue-green switch ``{"v2": 100}``, and a rollback
puts the previous split back. It can be sticky: every request of one API key
(or one OpenAI ``user``) then lands on the same version. The control plane
stores rollouts and publishes them as the locality metadata
``inferlb.rollouts`` of the rich EDS, encoded by :func:`encode_rollouts`;
ext_proc decodes them with :func:`decode_rollouts`, resolves each request's
``model`` with :meth:`Rollout.choose` and tells the worker which version to
run in :data:`MODEL_HEADER`; the worker names the version that served it in
the same header on its answer and in the body's ``model``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, get_args

MODEL_HEADER = "x-inferlb-model"  # request: the version ext_proc chose; response: the version that served
# Keys in the rich EDS (metadata namespace "inferlb").
MODELS_KEY = "models"  # endpoint: list of the version ids it serves
ALIASES_KEY = "model_aliases"  # endpoint: list of the aliases it answers to
POOL_KEY = "pool"  # endpoint: the name of its pool (the group of workers that scale together)
ROLLOUTS_KEY = "rollouts"  # locality: encode_rollouts(...)
DEFAULT_POOL = "default"
# A model id or alias: what OpenAI and Hugging Face names look like (``org/name-v2.1``), short and plain
# because it becomes a metric label value and an HTTP header value.
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
POOL_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a Kubernetes name: it names a Deployment

Sticky = Literal["none", "api_key", "user"]
STICKY_MODES: tuple[str, ...] = get_args(Sticky)


class InvalidRollouts(ValueError):
    """A rollout table that does not follow the contract; the message says what is wrong."""


def check_model_name(name: str, what: str = "model") -> str:
    """``name`` if it is a valid model id or alias, else ``ValueError`` saying why."""
    if not isinstance(name, str) or not MODEL_NAME_PATTERN.match(name):
        raise ValueError(f"{what} {name!r} must be 1-128 characters: letters, digits and . _ : / -, "
                         "starting with a letter or digit")
    return name


@dataclass(frozen=True, slots=True)
class Rollout:
    """An alias's traffic split over versions; percentages are positive and sum to 100."""

    alias: str
    versions: tuple[tuple[str, float], ...]  # (version, percent), in the order given
    sticky: Sticky = "none"

    def __post_init__(self) -> None:
        check_model_name(self.alias, "alias")
        if not self.versions:
            raise ValueError(f"rollout of {self.alias!r} names no version")
        seen: set[str] = set()
        for version, percent in self.versions:
            check_model_name(version, "version")
            if version == self.alias:
                raise ValueError(f"rollout of {self.alias!r} names itself as a version")
            if version in seen:
                raise ValueError(f"rollout of {self.alias!r} names version {version!r} twice")
            seen.add(version)
            if not (isinstance(percent, (int, float)) and math.isfinite(percent) and 0 < percent <= 100):
                raise ValueError(f"rollout of {self.alias!r}: the percentage of {version!r} must be in (0, 100], "
                                 f"got {percent!r}")
        total = sum(percent for _, percent in self.versions)
        if abs(total - 100.0) > 1e-6:
            raise ValueError(f"rollout of {self.alias!r}: percentages must sum to 100, got {total:g}")
        if self.sticky not in STICKY_MODES:
            raise ValueError(f"rollout of {self.alias!r}: sticky must be one of {', '.join(STICKY_MODES)}, "
                             f"got {self.sticky!r}")

    def choose(self, bucket: float) -> str:
        """The version for a request whose bucket (uniform in [0, 1)) is ``bucket``."""
        point = bucket * 100.0
        cumulative = 0.0
        for version, percent in self.versions:
            cumulative += percent
            if point < cumulative:
                return version
        return self.versions[-1][0]  # rounding at the top end

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(version for version, _ in self.versions)


def sticky_bucket(alias: str, who: str) -> float:
    """A stable bucket in [0, 1) for one caller (an API key id, a user) of one alias: the same caller
    lands on the same version until the split moves past its bucket, and callers spread uniformly."""
    digest = hashlib.sha256(f"{alias}\x00{who}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def encode_rollouts(rollouts: Iterable[Rollout]) -> dict[str, Any]:
    """The locality metadata value (a JSON/Struct object), deterministic: aliases sorted."""
    return {r.alias: {"versions": [{"model": v, "percent": float(p)} for v, p in r.versions], "sticky": r.sticky}
            for r in sorted(rollouts, key=lambda r: r.alias)}


def decode_rollouts(doc: Any) -> Mapping[str, Rollout]:
    """The rollouts by alias from :func:`encode_rollouts`'s shape; :class:`InvalidRollouts` if malformed."""
    if not isinstance(doc, Mapping):
        raise InvalidRollouts(f"rollouts must be an object of alias -> rollout, got {type(doc).__name__}")
    out: dict[str, Rollout] = {}
    for alias, spec in doc.items():
        try:
            if not isinstance(spec, Mapping) or not isinstance(spec.get("versions"), (list, tuple)):
                raise ValueError(f"rollout of {alias!r} must be {{versions: [{{model, percent}}], sticky}}")
            versions = []
            for entry in spec["versions"]:
                if not isinstance(entry, Mapping) or set(entry) != {"model", "percent"}:
                    raise ValueError(f"rollout of {alias!r}: each version must be {{model, percent}}, got {entry!r}")
                versions.append((entry["model"], entry["percent"]))
            out[alias] = Rollout(alias, tuple(versions), spec.get("sticky", "none"))
        except (ValueError, TypeError) as exc:
            raise InvalidRollouts(str(exc)) from None
    return out
