"""A benchmark scenario: the fleet, the workload, the loads and the data planes to compare.

One scenario file (TOML) drives both the live bench (``inferlb bench``) and the
fleet simulator (``inferlb sim``), so the two can be compared on the same trace
and seed. Every field has a default: an empty file is the issue's default
scenario (8 emulated workers with speeds 1, 1, 1, 1, 0.5, 0.5, 0.25, 0.25).
A large fleet is written as ``[fleet] groups = [{count, speed, slots}, ...]``
(and ``repeat``) instead of a list of every worker; it is expanded on load.

Emulated service time of a request of ``n`` tokens on a worker of speed ``s``::

    (fixed_s + per_token_s * n) * cost_scale / s

``fixed_s`` and ``per_token_s`` default to the fit of the real int8 model on
this machine (``workers.simulated``); ``cost_scale`` stretches time so that the
emulated fleet, not the 2-core host running it, is the bottleneck.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

# The data-plane configurations the runner knows (issue 6, section 3). ``inferlb_pick:<name>``
# runs inferlb + ext_proc with the named pick policy.
CONFIGURATIONS = (
    "envoy_round_robin",  # (a)
    "envoy_least_request",  # (b)
    "envoy_cswrr_orca",  # (c) client_side_weighted_round_robin fed by the workers' ORCA reports
    "nginx_least_conn",  # (d)
    "inferlb_weights",  # (e) control plane weights, no ext_proc
    "inferlb_ext_proc",  # (f) weights + ext_proc's default pick policy
)
PICK_PREFIX = "inferlb_pick:"  # (g) e.g. "inferlb_pick:round_robin"


def known_configuration(configuration: str) -> bool:
    """One of ``CONFIGURATIONS``, or ``inferlb_pick:<policy>`` with a policy named."""
    return configuration in CONFIGURATIONS or (configuration.startswith(PICK_PREFIX)
                                               and len(configuration) > len(PICK_PREFIX))


# Fit of the int8 all-MiniLM-L6-v2 on one core here (same numbers as workers/simulated.py;
# the bench and the simulator must not import the workers service, so they are repeated).
MODEL_FIXED_S = 0.001
MODEL_PER_TOKEN_S = 0.000114


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class LengthBucket:
    """``share`` of the requests have a token count drawn uniformly from [min_tokens, max_tokens].

    Token counts include [CLS] and [SEP], as the worker and ext_proc count them.
    """

    share: float
    min_tokens: int
    max_tokens: int


DEFAULT_MIX = (LengthBucket(0.70, 8, 32), LengthBucket(0.25, 64, 128), LengthBucket(0.05, 256, 256))


@dataclass(frozen=True)
class ClassMix:
    """Shares of the request classes (``x-gateway-inference-objective``); by default every request is standard."""

    critical: float = 0.0
    standard: float = 1.0
    sheddable: float = 0.0

    def shares(self) -> tuple[float, float, float]:
        """In ``Priority`` order (critical, standard, sheddable)."""
        return (self.critical, self.standard, self.sheddable)


@dataclass(frozen=True)
class Workload:
    mix: tuple[LengthBucket, ...] = DEFAULT_MIX
    classes: ClassMix = field(default_factory=ClassMix)
    inputs_per_request: int = 1
    arrival: Literal["poisson", "bursty"] = "poisson"
    # bursty on/off: Poisson at rate * (on_s + off_s) / on_s during "on", nothing during "off"
    burst_on_s: float = 1.0
    burst_off_s: float = 1.0
    # Repeated inputs (issue 16: what a response cache can answer): each request is, with probability
    # repeat_rate, a repeat of one of the first repeat_pool distinct texts sent, drawn Zipf(repeat_zipf_s)
    # by rank (the first text sent is the most popular); else a fresh text. 0: no deliberate repeats.
    repeat_rate: float = 0.0
    repeat_pool: int = 1000
    repeat_zipf_s: float = 1.1


PRECISIONS = ("int8", "fp32")
FLEET_KINDS = ("emulated", "onnx")
MIN_CPU_QUOTA = 0.01  # of a core: the kernel's floor is a 1 ms quota per 100 ms period


@dataclass(frozen=True)
class WorkerSpec:
    """One worker. ``speed`` and ``slots`` shape an emulated worker; ``precision``, ``threads`` and
    ``cpu_quota`` (a fraction of a core through a cgroup, 0: none) a real ONNX one (``[fleet] kind = "onnx"``),
    whose ``speed`` only tells ``inferlb sim`` roughly how fast it is (the live bench measures it)."""

    speed: float = 1.0
    slots: int = 1  # requests served at once; the rest queue FIFO
    precision: str = "int8"
    threads: int = 1
    cpu_quota: float = 0.0

    @property
    def kind(self) -> str:
        """A real worker's label, e.g. ``int8 1t`` or ``int8 1t q0.3``: workers of one kind share a cost curve."""
        return f"{self.precision} {self.threads}t" + (f" q{self.cpu_quota:g}" if self.cpu_quota else "")


DEFAULT_SPEEDS = (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25)
MAX_WORKERS = 100_000  # a fleet larger than this is a typo, not a scenario (the simulator's own ceiling)


@dataclass(frozen=True)
class WorkerGroup:
    """``count`` identical workers: the compact form of ``fleet.workers`` for large fleets (input only;
    ``Fleet`` holds the expanded list, so a scenario written back out reads the same)."""

    count: int = 1
    speed: float = 1.0
    slots: int = 1


def expand_groups(groups: tuple[WorkerGroup, ...], repeat: int = 1, where: str = "fleet") -> tuple[WorkerSpec, ...]:
    """The workers of ``groups`` in order (each group's ``count`` in a row), the whole list ``repeat`` times:
    deterministic, so a run replays. Refuses, by name, empty or bad groups and more than ``MAX_WORKERS``."""
    if not groups:
        raise ScenarioError(f"{where}.groups needs at least one group")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ScenarioError(f"{where}.repeat must be an integer >= 1, got {repeat!r}")
    for i, g in enumerate(groups):
        at = f"{where}.groups[{i}]"
        if isinstance(g.count, bool) or not isinstance(g.count, int) or g.count < 1:
            raise ScenarioError(f"{at}.count must be an integer >= 1, got {g.count!r}")
        if isinstance(g.slots, bool) or not isinstance(g.slots, int) or g.slots < 1:
            raise ScenarioError(f"{at}.slots must be an integer >= 1, got {g.slots!r}")
        if not g.speed > 0:
            raise ScenarioError(f"{at}.speed must be > 0, got {g.speed!r}")
    total = sum(g.count for g in groups) * repeat
    if total > MAX_WORKERS:
        raise ScenarioError(f"{where}.groups describe {total:,} workers; at most {MAX_WORKERS:,}")
    once = tuple(WorkerSpec(g.speed, g.slots) for g in groups for _ in range(g.count))
    return once * repeat


@dataclass(frozen=True)
class Fleet:
    """``kind = "emulated"``: ``python -m workers --simulate`` on the cost curve below. ``kind = "onnx"``:
    real workers running the model (each worker's precision, threads and CPU quota); the curve is then
    measured by the bench (``real_fleet_calibration.py``), and these cost fields are not used."""

    workers: tuple[WorkerSpec, ...] = tuple(WorkerSpec(s) for s in DEFAULT_SPEEDS)
    kind: str = "emulated"
    calibration: str = "full"  # a real fleet's cost-curve sweep: "full" (~25 s per kind) or "quick" (~8 s)
    fixed_s: float = MODEL_FIXED_S
    per_token_s: float = MODEL_PER_TOKEN_S
    cost_scale: float = 4.0
    models: tuple[str, ...] = ()  # the model versions every worker serves (empty: the worker's default)

    def service_s(self, worker: int, tokens: int, speed: float | None = None) -> float:
        """Emulated service seconds of one request of ``tokens`` tokens on worker ``worker``."""
        s = self.workers[worker].speed if speed is None else speed
        return (self.fixed_s + self.per_token_s * tokens) * self.cost_scale / s


@dataclass(frozen=True)
class Slowdown:
    """The mid-run slowdown run: worker ``worker``'s speed is multiplied by ``factor`` at ``at_s`` and, when
    ``duration_s`` > 0, restored ``duration_s`` later (0: slow until the run ends, the original form)."""

    worker: int = 0
    factor: float = 0.25
    at_s: float = 10.0
    duration_s: float = 0.0
    load: float = 0.7  # fraction of capacity for the slowdown run


@dataclass(frozen=True)
class Scenario:
    name: str = "default"
    seed: int = 1
    duration_s: float = 20.0  # of each measured run
    warmup_s: float = 3.0  # sent, not measured
    slo_s: float = 0.25  # goodput counts completions within this; capacity is where p99 crosses it
    request_timeout_s: float = 10.0
    # req/s at 100% load; 0: find it first, under inferlb_ext_proc (the definition)
    capacity_rps: float = 0.0
    # Seconds each capacity probe measures; 0: the default (min(8 s, duration_s)), fast enough for the
    # routing bench's search. Near capacity a short probe ends before the queues have grown: its p99
    # flatters the load, so a scenario whose verdict is a share of capacity probes as long as it runs.
    probe_duration_s: float = 0.0
    loads: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9)
    slowdown: Slowdown | None = field(default_factory=Slowdown)
    workload: Workload = field(default_factory=Workload)
    fleet: Fleet = field(default_factory=Fleet)
    configurations: tuple[str, ...] = CONFIGURATIONS
    # pick policies run as (g) at the "pick_policy_loads" only (keeps the full run under 30 minutes)
    pick_policies: tuple[str, ...] = ()
    pick_policy_loads: tuple[float, ...] = (0.8,)
    # the simulator's knobs (inferlb sim); the live bench ignores them
    scrape_interval_s: float = 0.5
    ext_proc_replicas: int = 1
    # Per-request time the simulator does not model, added to every simulated latency: the HTTP
    # hops, tokenising and the proxy (hop) and, for the ext_proc configurations, ext_proc's gRPC
    # round trip. A constant delay before the worker does not change queueing, so adding it at the
    # end is exact. Calibrated on this host: live minus simulated p50 at 50% load (docs/simulator.md).
    hop_overhead_s: float = 0.003
    ext_proc_overhead_s: float = 0.004
    # The pick policy's slo_ms in the simulator's ext_proc: sheddable requests predicted to complete
    # later are shed (429); 0 turns shedding off. The product's default; ``inferlb bench overload``
    # sets the live one through the admin API.
    shed_slo_ms: float = 2000.0

    def __post_init__(self) -> None:
        _validate(self)


def _validate(s: Scenario) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ScenarioError(message)

    need(s.duration_s > 0 and s.warmup_s >= 0, "duration_s must be > 0 and warmup_s >= 0")
    need(s.slo_s > 0 and s.request_timeout_s > 0, "slo_s and request_timeout_s must be > 0")
    need(s.capacity_rps >= 0, "capacity_rps must be >= 0 (0: search for it)")
    need(s.probe_duration_s >= 0, "probe_duration_s must be >= 0 (0: the default, min(8, duration_s))")
    need(all(0 < x <= 2 for x in s.loads), "loads are fractions of capacity in (0, 2]")
    need(len(s.fleet.workers) >= 1, "fleet.workers needs at least one worker")
    need(len(s.fleet.workers) <= MAX_WORKERS, f"fleet.workers: at most {MAX_WORKERS:,} workers")
    need(all(w.speed > 0 and w.slots >= 1 for w in s.fleet.workers), "every worker needs speed > 0 and slots >= 1")
    _validate_real_fleet(s)
    need(s.fleet.cost_scale > 0 and s.fleet.fixed_s >= 0 and s.fleet.per_token_s >= 0,
         "fleet.cost_scale must be > 0 and the costs >= 0")
    mix = s.workload.mix
    # 3 tokens: [CLS], one word, [SEP] (the bench sends text; an empty text has no word to count)
    need(len(mix) >= 1 and all(b.share > 0 and 3 <= b.min_tokens <= b.max_tokens <= 256 for b in mix),
         "workload.mix buckets need share > 0 and 3 <= min_tokens <= max_tokens <= 256")
    need(abs(sum(b.share for b in mix) - 1.0) < 1e-6, "workload.mix shares must add up to 1")
    need(s.workload.arrival in ("poisson", "bursty"),
         f"workload.arrival must be 'poisson' or 'bursty', got {s.workload.arrival!r}")
    need(s.workload.inputs_per_request >= 1, "workload.inputs_per_request must be >= 1")
    shares = s.workload.classes.shares()
    need(all(x >= 0 for x in shares) and abs(sum(shares) - 1.0) < 1e-6,
         "workload.classes shares (critical, standard, sheddable) must be >= 0 and add up to 1")
    need(0 <= s.shed_slo_ms <= 3_600_000, "shed_slo_ms must be in [0, 3600000] (0: no shedding)")
    need(s.workload.burst_on_s > 0 and s.workload.burst_off_s >= 0, "burst_on_s must be > 0, burst_off_s >= 0")
    need(0 <= s.workload.repeat_rate <= 1, f"workload.repeat_rate must be in [0, 1], got {s.workload.repeat_rate!r}")
    need(s.workload.repeat_pool >= 1, f"workload.repeat_pool must be >= 1, got {s.workload.repeat_pool!r}")
    need(s.workload.repeat_zipf_s > 0, f"workload.repeat_zipf_s must be > 0, got {s.workload.repeat_zipf_s!r}")
    for c in s.configurations:
        need(known_configuration(c),
             f"unknown configuration {c!r}; known: {', '.join(CONFIGURATIONS)}, {PICK_PREFIX}<policy>")
    if s.slowdown is not None:
        need(0 <= s.slowdown.worker < len(s.fleet.workers), "slowdown.worker is not a worker index")
        need(s.slowdown.factor > 0 and s.slowdown.at_s >= 0, "slowdown.factor must be > 0 and at_s >= 0")
        need(s.slowdown.duration_s >= 0, "slowdown.duration_s must be >= 0 (0: slow until the run ends)")
    need(s.scrape_interval_s > 0 and s.ext_proc_replicas >= 1, "scrape_interval_s > 0, ext_proc_replicas >= 1")
    need(s.hop_overhead_s >= 0 and s.ext_proc_overhead_s >= 0, "hop_overhead_s and ext_proc_overhead_s must be >= 0")


def _validate_real_fleet(s: Scenario) -> None:
    """Real-worker fields: only on an ``onnx`` fleet, in range; no slowdown (a real worker has no speed knob)."""
    fleet = s.fleet
    if fleet.kind not in FLEET_KINDS:
        raise ScenarioError(f"fleet.kind must be one of {', '.join(FLEET_KINDS)}, got {fleet.kind!r}")
    default = WorkerSpec()
    for i, w in enumerate(fleet.workers):
        at = f"fleet.workers[{i}]"
        if fleet.kind == "emulated":
            for name in ("precision", "threads", "cpu_quota"):
                if getattr(w, name) != getattr(default, name):
                    raise ScenarioError(f"{at}.{name} is for real workers: set fleet.kind = \"onnx\"")
            continue
        if w.precision not in PRECISIONS:
            raise ScenarioError(f"{at}.precision must be one of {', '.join(PRECISIONS)}, got {w.precision!r}")
        if isinstance(w.threads, bool) or not isinstance(w.threads, int) or not 1 <= w.threads <= 64:
            raise ScenarioError(f"{at}.threads must be an integer in [1, 64], got {w.threads!r}")
        if not (w.cpu_quota == 0 or MIN_CPU_QUOTA <= w.cpu_quota <= 64):
            raise ScenarioError(f"{at}.cpu_quota is a fraction of a core in [{MIN_CPU_QUOTA}, 64] (0: no quota), "
                                f"got {w.cpu_quota!r}")
        if w.slots != 1:
            raise ScenarioError(f"{at}.slots is for emulated workers; a real worker batches (set precision, "
                                "threads, cpu_quota)")
    if fleet.calibration not in ("full", "quick"):
        raise ScenarioError(f"fleet.calibration must be 'full' or 'quick', got {fleet.calibration!r}")
    if fleet.kind == "onnx" and s.slowdown is not None:
        raise ScenarioError("slowdown needs an emulated fleet (a real worker has no speed to change): "
                            "set slowdown = false")


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """A frozen dataclass from a TOML table: unknown keys and wrong types are refused by name."""
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{where or 'scenario'} must be a table")
    if cls is Fleet:
        data = _fleet_groups(data, where)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ScenarioError(f"{where or 'scenario'}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    values: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        spec = known[name]
        if spec.default is not MISSING:
            default = spec.default
        elif spec.default_factory is not MISSING:
            default = spec.default_factory()
        else:  # required field: its type annotation tells (LengthBucket's numbers)
            default = 0.0 if spec.type in ("float", float) else 0
        values[name] = _convert(name, value, default, path)
    try:
        return cls(**values)
    except TypeError as exc:
        raise ScenarioError(f"{where or 'scenario'}: {exc}") from None


def _fleet_groups(data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """A ``[fleet]`` table with ``groups`` (and ``repeat``) instead of ``workers``, as the one with ``workers``."""
    if "groups" not in data:
        if "repeat" in data:
            raise ScenarioError(f"{where}.repeat needs {where}.groups")
        return data
    if "workers" in data:
        raise ScenarioError(f"{where}: give either workers or groups, not both")
    groups = data["groups"]
    if not isinstance(groups, list):
        raise ScenarioError(f"{where}.groups must be an array of tables")
    built = tuple(_build(WorkerGroup, g, f"{where}.groups[{i}]") for i, g in enumerate(groups))
    rest = {k: v for k, v in data.items() if k not in ("groups", "repeat")}
    return {**rest, "workers": expand_groups(built, data.get("repeat", 1), where)}


def _convert(name: str, value: Any, default: Any, path: str) -> Any:
    if name == "mix":
        if not isinstance(value, list):
            raise ScenarioError(f"{path} must be an array of tables")
        return tuple(_build(LengthBucket, v, f"{path}[{i}]") for i, v in enumerate(value))
    if name == "workers" and isinstance(value, tuple):  # expanded from groups
        return value
    if name == "workers" and isinstance(value, list):
        return tuple(_build(WorkerSpec, v, f"{path}[{i}]") if isinstance(v, Mapping) else WorkerSpec(float(v))
                     for i, v in enumerate(value))
    if name == "slowdown":
        return None if value is False else _build(Slowdown, value, path)
    if is_dataclass(default):
        return _build(type(default), value, path)
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise ScenarioError(f"{path} must be an array")
        return tuple(value)
    if isinstance(default, bool) or isinstance(default, str):
        if type(value) is not type(default):
            raise ScenarioError(f"{path} must be a {type(default).__name__}, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(f"{path} must be a number, got {value!r}")
        return type(default)(value) if isinstance(default, float) or value == int(value) else value
    return value


def scenario_from_mapping(data: Mapping[str, Any]) -> Scenario:
    return _build(Scenario, data, "")


def load_scenario(path: Path | None) -> Scenario:
    """The scenario in ``path`` (TOML), or the default scenario when ``path`` is None."""
    if path is None:
        return Scenario()
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario {path} is not valid TOML: {exc}") from None
    return scenario_from_mapping(data)
