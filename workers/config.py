"""Worker configuration: defaults, then a TOML file's ``[worker]`` table, then
``INFERLB_WORKER_*`` environment variables, then command-line flags.

One frozen dataclass holds the result so every part of the worker reads the
same validated values.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from inferlb_runtime.model_routing import DEFAULT_POOL, POOL_PATTERN

from .model_catalog import Precision, check_versions, default_version
from .queue_order import AGING_S, SCHEDULINGS

ENV_PREFIX = "INFERLB_WORKER_"


def default_data_dir() -> Path:
    """Where models, logs and state live: ``$INFERLB_DATA_DIR`` or ``./.inferlb``."""
    return Path(os.environ.get("INFERLB_DATA_DIR", ".inferlb")).resolve()


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 8101
    data_dir: Path = field(default_factory=default_data_dir)
    # The precision of the version served when ``models`` names none (the flag worked so before versions).
    precision: Precision = "int8"
    # The model versions served (workers/model_catalog.py), the first answering requests that name none;
    # empty: the one version of ``precision``.
    models: tuple[str, ...] = ()
    # The pool: the group of workers that scale together (it names a Kubernetes Deployment).
    pool: str = DEFAULT_POOL
    # ONNX Runtime threads. Two 1-thread workers beat one 2-thread worker here.
    intra_op_threads: int = 1
    allow_spinning: bool = False
    # Cores the worker is allotted; cpu_utilization is reported as a fraction of it.
    cpus: float = 1.0
    # Micro-batching: padded tokens and items per batch, and the cap of the adaptive window.
    # Small batches win on one core: int8 mixed-length throughput measured 8.5k tokens/s at
    # 256-512 padded tokens per batch, 7.3k at 2048, 5.9k at 4096 (cache), 7.3k unbatched.
    # 256, not 512: a short request waits for the batch in progress, and with full-length inputs
    # queued that batch is half as long (bench hogs: one-sentence p99 143 ms at 512, 33-41 ms at 256).
    max_batch_tokens: int = 256
    max_batch_size: int = 64
    max_batch_wait_ms: float = 5.0
    # The order of waiting requests within a class (workers/queue_order.py): las (least attained service),
    # round_robin, or fifo (arrival order, the old batcher); a class climbs one per aging_s waited.
    scheduling: str = "las"
    aging_s: float = AGING_S
    # Request limits.
    max_inputs: int = 2048
    # Tokens one request may bring (all inputs, after truncation): about 2 s of work on one core
    # (0.114 ms a token, int8); a larger job is refused with 400 and asked to split.
    max_request_tokens: int = 16384
    max_body_bytes: int = 4 * 1024 * 1024
    max_queue_items: int = 8192
    # The per-input cache (workers/input_cache.py): bytes of vectors kept, least recently used evicted;
    # 0 turns the cache and the coalescing of identical inputs in flight off. Simulated workers have none.
    cache_max_bytes: int = 32 * 1024 * 1024
    # Seconds in-flight requests get to finish after SIGTERM.
    shutdown_timeout_s: float = 30.0
    access_log: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.port < 65536:
            problems.append(f"port must be 1..65535, got {self.port}")
        if self.precision not in ("int8", "fp32"):
            problems.append(f"precision must be int8 or fp32, got {self.precision!r}")
        object.__setattr__(self, "models", tuple(self.models))  # a list from code or TOML: still frozen
        if self.models:
            try:
                check_versions(self.models)
            except ValueError as exc:
                problems.append(str(exc))
        if not isinstance(self.pool, str) or not POOL_PATTERN.match(self.pool):
            problems.append(f"pool must be a Kubernetes name (lower-case letters, digits and '-', at most 63), "
                            f"got {self.pool!r}")
        for name in ("intra_op_threads", "max_batch_tokens", "max_batch_size", "max_inputs",
                     "max_request_tokens", "max_body_bytes", "max_queue_items"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scheduling not in SCHEDULINGS:
            problems.append(f"scheduling must be one of {', '.join(SCHEDULINGS)}, got {self.scheduling!r}")
        for name in ("cpus", "shutdown_timeout_s", "aging_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cache_max_bytes < 0:
            problems.append(f"cache_max_bytes must be >= 0 (0: no cache), got {self.cache_max_bytes}")
        if self.max_batch_wait_ms < 0:
            problems.append(f"max_batch_wait_ms must be >= 0, got {self.max_batch_wait_ms}")
        if problems:
            raise ValueError("invalid worker config: " + "; ".join(problems))

    @property
    def served_models(self) -> tuple[str, ...]:
        """The version ids this worker serves, in order: ``models``, or the version of ``precision``."""
        return tuple(self.models) or (default_version(self.precision),)


def _coerce(name: str, raw: Any, default: Any) -> Any:
    """Turn a string (env) or TOML value into the type of the field's default."""
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if isinstance(default, Path):
        return Path(raw).resolve()
    if isinstance(default, tuple):  # a TOML list, or "a,b" from the environment or a flag
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
            raise ValueError(f"{name}: expected a list of strings or a comma-separated string, got {raw!r}")
        return tuple(item.strip() for item in items if item.strip())
    try:
        return type(default)(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {type(default).__name__}, got {raw!r}") from None


def load_config(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerConfig:
    """Merge defaults, the config file, the environment and explicit overrides."""
    environ = os.environ if environ is None else environ
    base = WorkerConfig()
    known = {f.name for f in fields(WorkerConfig)}
    values: dict[str, Any] = {}

    if config_file is not None:
        with open(config_file, "rb") as fh:
            table = tomllib.load(fh).get("worker", {})
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{config_file}: unknown [worker] keys: {', '.join(sorted(unknown))}")
        values.update(table)
    for name in known:
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = environ[env_name]
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value

    coerced = {k: _coerce(k, v, getattr(base, k)) for k, v in values.items()}
    return dataclasses.replace(base, **coerced)
