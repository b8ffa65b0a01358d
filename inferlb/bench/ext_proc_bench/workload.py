"""The ext_proc bench's requests: short real OpenAI embeddings bodies, and open-loop schedules."""

from __future__ import annotations

import json
import random

import numpy as np

from ..load.scenario import LengthBucket, Workload
from ..load.texts import CORPUS, MODEL
from ..load.trace import Trace, build_trace

PATH = "/v1/embeddings"


def make_bodies(count: int, seed: int, min_words: int = 4, max_words: int = 24) -> list[bytes]:
    """Real OpenAI embeddings bodies, one short text each (about 6-35 tokens), all distinct."""
    words = (CORPUS * 4).split()
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        n = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words) - n)
        text = f"{' '.join(words[start:start + n])} (#{i})"
        bodies.append(json.dumps({"model": MODEL, "input": text, "encoding_format": "base64"}).encode())
    return bodies


def schedule(rate: float, seconds: float, arrivals: str, seed: int) -> Trace:
    """The send times of one open-loop run: Poisson (the bench's own traces) or uniform (every 1/rate s).
    Token counts are not used here: the bodies are cycled."""
    if arrivals == "uniform":
        n = max(1, round(rate * seconds))
        zeros = np.zeros(n, dtype=np.int64)
        return Trace(np.arange(n, dtype=np.float64) / rate, zeros, zeros.copy(), float(rate), float(seconds), seed)
    if arrivals != "poisson":
        raise ValueError(f"arrivals is poisson or uniform, got {arrivals!r}")
    return build_trace(Workload(mix=(LengthBucket(1.0, 8, 32),)), rate, seconds, seed)


def cycled(bodies: list[bytes], n: int) -> list[bytes]:
    """One body per request: ``bodies`` over and over."""
    return [bodies[i % len(bodies)] for i in range(n)]
