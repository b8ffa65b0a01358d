"""Simulated inference (``python -m workers --simulate``): a stand-in for machines
this host does not have.

Everything but the model is real: the HTTP API, tokenisation, micro-batching,
metrics and the ORCA header. The model is replaced by a timed wait of
``(fixed + per_token * padded_tokens) / speed`` seconds on the inference
thread, and the vectors are dummies (deterministic unit vectors). So one
machine can hold a heterogeneous fleet of 8-16 workers, and a test or a
benchmark can slow one down at run time (a noisy neighbour, throttling).
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Sequence

import numpy as np

# Fitted to the int8 all-MiniLM-L6-v2 on one core of the development machine
# (a least-squares fit over length-batched and single inputs of the benchmark mix):
# batch seconds = FIXED + PER_TOKEN * padded tokens.
DEFAULT_FIXED_S = 0.001
DEFAULT_PER_TOKEN_S = 0.000114


def parse_speed_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"30:0.25,60:1"`` → ((30.0, 0.25), (60.0, 1.0)): at t seconds after start, set speed."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        at, sep, speed = part.partition(":")
        try:
            step = (float(at), float(speed))
        except ValueError:
            raise ValueError(f"speed schedule step {part!r} is not SECONDS:SPEED") from None
        if not sep or step[0] < 0 or step[1] <= 0:
            raise ValueError(f"speed schedule step {part!r} needs SECONDS >= 0 and SPEED > 0")
        steps.append(step)
    return tuple(sorted(steps))


class Simulation:
    """The simulated machine: its speed (settable at run time) and the busy time it has spent."""

    def __init__(
        self,
        *,
        speed: float = 1.0,
        fixed_s: float = DEFAULT_FIXED_S,
        per_token_s: float = DEFAULT_PER_TOKEN_S,
        schedule: Sequence[tuple[float, float]] = (),
    ) -> None:
        if speed <= 0 or fixed_s < 0 or per_token_s < 0:
            raise ValueError("speed must be > 0 and costs >= 0")
        self._speed = speed
        self.fixed_s = fixed_s
        self.per_token_s = per_token_s
        self._schedule = list(schedule)
        self._started = time.monotonic()
        self._busy = 0.0
        self._lock = threading.Lock()

    @property
    def speed(self) -> float:
        with self._lock:
            elapsed = time.monotonic() - self._started
            while self._schedule and self._schedule[0][0] <= elapsed:
                self._speed = self._schedule.pop(0)[1]
            return self._speed

    def set_speed(self, speed: float) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        with self._lock:
            self._speed = speed

    def batch_seconds(self, padded_tokens: int) -> float:
        return (self.fixed_s + self.per_token_s * padded_tokens) / self.speed

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds

    def busy_seconds(self) -> float:
        """Cumulative simulated compute: reported as the worker's CPU time."""
        with self._lock:
            return self._busy


class SimulatedEngine:
    """Implements the service's ``EmbeddingEngine`` with a timed wait instead of a model."""

    def __init__(self, simulation: Simulation, dimensions: int = 384) -> None:
        self.simulation = simulation
        self._dimensions = dimensions

    @property
    def dimensions(self) -> int:
        return self._dimensions

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        seconds = self.simulation.batch_seconds(max(len(item) for item in batch) * len(batch))
        time.sleep(seconds)  # the simulated compute, on the inference thread
        self.simulation.add_busy(seconds)
        vectors = np.empty((len(batch), self._dimensions), dtype=np.float32)
        for row, item in enumerate(batch):
            seed = zlib.crc32(np.asarray(item, dtype=np.int64).tobytes())
            v = np.random.default_rng(seed).standard_normal(self._dimensions)
            vectors[row] = v / np.linalg.norm(v)
        return vectors
