"""Predicted service time of a request on each endpoint, learnt online from the workers' own timings.

What is learnt: **compute** seconds (``server-timing: compute;dur=``), not
total latency. The cost is what a request adds to an endpoint's backlog;
the time it waits there is modelled separately as outstanding work
(ext_proc's in-flight predictions plus the worker's reported load). Learning
total latency instead would count queueing twice and would make a busy
endpoint look permanently slow after its queue drained.

Model, per endpoint e, for n tokens (u = n / token_scale keeps the algebra
well conditioned)::

    cost_e(n) = a_e + b_e * u (+ c_e * u^2 when quadratic=True)

fitted by exponentially-forgotten ridge least squares: decayed sufficient
statistics S = sum w x x^T, r = sum w x y (decay per observation) and a ridge
rho pulling theta to the prior: theta = (S + rho I)^-1 (r + rho prior). rho
starts at ``prior_strength`` pseudo-observations and decays with the data
down to ``prior_floor``, which never decays: early predictions stay near the
prior, a well-fed fit is unbiased, and an endpoint with little variety in
request sizes keeps the prior's slope instead of winding up. The prior is the worker's own batch-cost
fit from telemetry (``batch_cost_fixed_s`` + ``batch_cost_per_token_s``)
when the control plane sends it, else the configured defaults (fitted on this
machine: ~4 ms for 16 tokens, ~64 ms for 256).

Per model version: an endpoint serving two versions (int8 and fp32) runs them
at different speeds, so each (endpoint, version) gets a fit of its own, fed
by the responses that name their version, with the endpoint's fit (all its
responses) as its prior. A prediction for a version uses the version's fit
once it has learnt from a response, the endpoint's before (and for requests
whose version is not known: a bare alias, a fleet without models).

Observations are clipped to [min(fit, prior)/clip, max(fit, prior)*clip]
before they are learnt, so one GC pause cannot wreck a fit, while a real
speed change still gets through within a few dozen responses.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

PER_TOKEN_KEY = "batch_cost_per_token_s"
FIXED_KEY = "batch_cost_fixed_s"
_MIN_COST_S = 1e-5
_APE_CAP = 10.0  # one absurd outlier must not dominate the error metric


@dataclass(frozen=True)
class CostParams:
    prior_fixed_s: float = 0.0  # a: ~4 ms at 16 tokens and ~64 ms at 256 fit a = 0, b = 0.25 ms/token
    prior_per_token_s: float = 0.00025  # b
    prior_per_token2_s: float = 0.0  # c (per token squared); used when quadratic
    quadratic: bool = False
    decay: float = 0.98  # per observation: ~50 responses of memory
    prior_strength: float = 2.0  # pseudo-observations behind the prior at first; they decay like data ...
    prior_floor: float = 0.001  # ... down to this, which never decays (no wind-up, negligible bias)
    clip: float = 5.0
    token_scale: float = 256.0
    mape_window: int = 256
    use_telemetry_prior: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.prior_strength <= 0 or not 0 < self.prior_floor <= self.prior_strength:
            raise ValueError("prior_strength must be > 0 and prior_floor in (0, prior_strength]")
        if self.clip <= 1.0:
            raise ValueError(f"clip must be > 1, got {self.clip}")
        if self.token_scale <= 0 or self.mape_window < 1:
            raise ValueError("token_scale must be > 0 and mape_window >= 1")
        if min(self.prior_fixed_s, self.prior_per_token_s, self.prior_per_token2_s) < 0:
            raise ValueError("prior coefficients must be >= 0")


@dataclass
class _Fit:
    """One endpoint's decayed statistics and its cached solution."""

    k: int
    s: list[list[float]]
    r: list[float]
    count: int = 0
    rho: float = 0.0
    prior: tuple[float, ...] = ()
    theta: tuple[float, ...] = ()
    apes: deque[float] = field(default_factory=deque)
    ape_sum: float = 0.0
    telemetry: Mapping[str, float] | None = None  # the mapping the prior was last read from


class CostModel:
    """Per-endpoint online cost fits; ``predict`` is O(1) (the solve is cached)."""

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = params or CostParams()
        p = self.params
        self._k = 3 if p.quadratic else 2
        self._default_prior = self._scaled(p.prior_fixed_s, p.prior_per_token_s, p.prior_per_token2_s)
        self._fits: dict[str, _Fit] = {}
        self._model_fits: dict[tuple[str, str], _Fit] = {}  # (endpoint, version) -> its own fit
        self._apes: deque[float] = deque(maxlen=p.mape_window)
        self._ape_sum = 0.0
        self.observations = 0

    # -- public ------------------------------------------------------------------------------
    def predict(self, endpoint_id: str, tokens: int, telemetry: Mapping[str, float] | None = None,
                model: str | None = None) -> float:
        """Predicted compute seconds of ``tokens`` on the endpoint (never below 10 µs), for ``model`` (a
        version) once the endpoint's fit for it has learnt something, else for any model."""
        if model is not None and self._model_fits:
            own = self._model_fits.get((endpoint_id, model))
            if own is not None and own.count:
                return self._eval(own.theta, tokens)
        fit = self._fits.get(endpoint_id)
        if fit is None:
            fit = self._fits[endpoint_id] = self._new_fit()
        if telemetry is not fit.telemetry or telemetry is None:
            # The telemetry mapping is replaced (not mutated) on each EDS update: re-read the prior only then.
            fit.telemetry = telemetry
            prior = self._prior(telemetry)
            if fit.prior != prior:
                fit.prior = prior
                fit.theta = self._solve(fit) if fit.count else prior
        return self._eval(fit.theta, tokens)

    def observe(self, endpoint_id: str, tokens: int, seconds: float, predicted_s: float | None = None,
                model: str | None = None) -> None:
        """Learn one response's compute seconds (of ``model``, the version that ran, when known: its own fit
        learns too). ``predicted_s``: what the pick predicted, for the error metric.

        Without ``predicted_s`` the error is taken against the model's current
        prediction (before this update). Non-finite or non-positive timings are ignored.
        """
        if not (seconds > 0.0 and math.isfinite(seconds)) or tokens < 0:
            return
        fit = self._fits.get(endpoint_id)
        if fit is None:
            fit = self._new_fit()
            self._fits[endpoint_id] = fit
        if model is not None:
            own = self._model_fits.get((endpoint_id, model))
            if own is None:  # its prior: what the endpoint's fit knows so far
                own = self._model_fits[(endpoint_id, model)] = self._new_fit(fit.theta)
            self._learn(own, tokens, seconds)
        current = self._eval(fit.theta, tokens)
        expected = predicted_s if predicted_s is not None and predicted_s > 0 else current
        ape = min(abs(expected - seconds) / seconds, _APE_CAP)
        self._record(fit, ape)
        self._learn(fit, tokens, seconds)
        self.observations += 1

    def _learn(self, fit: _Fit, tokens: int, seconds: float) -> None:
        """One clipped observation into a fit's decayed statistics, and its new solution."""
        current = self._eval(fit.theta, tokens)
        p = self.params
        # The window is anchored on the prior as well as the fit, so a fit gone bad cannot lock the truth out.
        anchor = self._eval(fit.prior, tokens)
        lo = min(current, anchor) / p.clip
        hi = max(current, anchor) * p.clip
        y = lo if seconds < lo else hi if seconds > hi else seconds
        x = self._features(tokens)
        d = p.decay
        k = self._k
        for i in range(k):
            row = fit.s[i]
            xi = x[i]
            for j in range(k):
                row[j] = row[j] * d + xi * x[j]
            fit.r[i] = fit.r[i] * d + xi * y
        fit.count += 1
        fit.rho = max(fit.rho * d, p.prior_floor)
        fit.theta = self._solve(fit)

    def coefficients(self, endpoint_id: str, telemetry: Mapping[str, float] | None = None,
                     model: str | None = None) -> tuple[float, ...]:
        """``(a_s, b_s_per_token[, c_s_per_token2])`` in unscaled units (of ``model``'s own fit when it has
        one), for reports and tests."""
        self.predict(endpoint_id, 0, telemetry)
        own = self._model_fits.get((endpoint_id, model)) if model is not None else None
        theta = own.theta if own is not None and own.count else self._fits[endpoint_id].theta
        scale = self.params.token_scale
        return tuple(t / scale**i for i, t in enumerate(theta))

    def mape(self, endpoint_id: str | None = None) -> float:
        """Mean absolute percentage error (a fraction) over the recent window; NaN before any data."""
        if endpoint_id is None:
            return self._ape_sum / len(self._apes) if self._apes else math.nan
        fit = self._fits.get(endpoint_id)
        if fit is None or not fit.apes:
            return math.nan
        return fit.ape_sum / len(fit.apes)

    def mape_by_endpoint(self) -> dict[str, float]:
        return {e: f.ape_sum / len(f.apes) for e, f in self._fits.items() if f.apes}

    def observed(self, endpoint_id: str, model: str | None = None) -> int:
        """How many responses the endpoint's fit (for ``model``: its fit for that version) has learnt from."""
        fit = self._fits.get(endpoint_id) if model is None else self._model_fits.get((endpoint_id, model))
        return fit.count if fit is not None else 0

    def retain(self, endpoint_ids: set[str] | frozenset[str]) -> None:
        """Forget endpoints that left the fleet (call on an EDS update)."""
        for gone in [e for e in self._fits if e not in endpoint_ids]:
            del self._fits[gone]
        for key in [k for k in self._model_fits if k[0] not in endpoint_ids]:
            del self._model_fits[key]

    # -- internals ---------------------------------------------------------------------------
    def _scaled(self, fixed: float, per_token: float, per_token2: float) -> tuple[float, ...]:
        scale = self.params.token_scale
        theta = (fixed, per_token * scale, per_token2 * scale * scale)
        return theta[: self._k]

    def _prior(self, telemetry: Mapping[str, float] | None) -> tuple[float, ...]:
        if telemetry and self.params.use_telemetry_prior:
            per_token = telemetry.get(PER_TOKEN_KEY, 0.0)
            if per_token and per_token > 0.0 and math.isfinite(per_token):
                fixed = telemetry.get(FIXED_KEY, 0.0) or 0.0
                fixed = fixed if fixed > 0.0 and math.isfinite(fixed) else 0.0
                return self._scaled(fixed, per_token, self.params.prior_per_token2_s)
        return self._default_prior

    def _features(self, tokens: int) -> tuple[float, ...]:
        u = tokens / self.params.token_scale
        return (1.0, u, u * u)[: self._k]

    def _eval(self, theta: tuple[float, ...], tokens: int) -> float:
        u = tokens / self.params.token_scale
        value = theta[0] + theta[1] * u
        if self._k == 3:
            value += theta[2] * u * u
        return value if value > _MIN_COST_S else _MIN_COST_S

    def _new_fit(self, prior: tuple[float, ...] | None = None) -> _Fit:
        k = self._k
        fit = _Fit(k=k, s=[[0.0] * k for _ in range(k)], r=[0.0] * k,
                   apes=deque(maxlen=self.params.mape_window))
        fit.rho = self.params.prior_strength
        fit.prior = fit.theta = prior if prior is not None else self._default_prior
        return fit

    def _solve(self, fit: _Fit) -> tuple[float, ...]:
        """theta = (S + rho I)^-1 (r + rho prior): in closed form for k = 2 (every response of a linear
        fit solves this), by Gaussian elimination otherwise."""
        k = fit.k
        rho = fit.rho
        if k == 2:
            (s00, s01), (s10, s11) = fit.s
            m00, m11 = s00 + rho, s11 + rho
            b0, b1 = fit.r[0] + rho * fit.prior[0], fit.r[1] + rho * fit.prior[1]
            det = m00 * m11 - s01 * s10
            if det > 1e-12 * m00 * m11:  # S + rho I is positive definite: only rounding can make it small
                return ((b0 * m11 - s01 * b1) / det, (m00 * b1 - s10 * b0) / det)
        m = [[fit.s[i][j] + (rho if i == j else 0.0) for j in range(k)] + [fit.r[i] + rho * fit.prior[i]]
             for i in range(k)]
        for col in range(k):
            pivot = max(range(col, k), key=lambda row: abs(m[row][col]))
            if abs(m[pivot][col]) < 1e-300:
                return fit.prior
            m[col], m[pivot] = m[pivot], m[col]
            for row in range(col + 1, k):
                f = m[row][col] / m[col][col]
                if f:
                    for j in range(col, k + 1):
                        m[row][j] -= f * m[col][j]
        theta = [0.0] * k
        for i in range(k - 1, -1, -1):
            acc = m[i][k] - sum(m[i][j] * theta[j] for j in range(i + 1, k))
            theta[i] = acc / m[i][i]
        return tuple(theta)

    def _record(self, fit: _Fit, ape: float) -> None:
        if len(self._apes) == self._apes.maxlen:
            self._ape_sum -= self._apes[0]
        self._apes.append(ape)
        self._ape_sum += ape
        if len(fit.apes) == fit.apes.maxlen:
            fit.ape_sum -= fit.apes[0]
        fit.apes.append(ape)
        fit.ape_sum += ape


# --- response headers ----------------------------------------------------------------------------


def parse_server_timing(value: str) -> dict[str, float]:
    """``server-timing`` (``queue;dur=1.2, compute;dur=5.6, total;dur=7.1``) as {name: SECONDS}.

    ``dur`` is milliseconds on the wire; entries without a numeric ``dur`` are
    skipped. Never raises.
    """
    out: dict[str, float] = {}
    if not value:
        return out
    for entry in value.split(","):
        parts = entry.split(";")
        name = parts[0].strip()
        if not name:
            continue
        for param in parts[1:]:
            key, _, raw = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    ms = float(raw.strip().strip('"'))
                except ValueError:
                    break
                if math.isfinite(ms) and ms >= 0:
                    out[name] = ms / 1000.0
                break
    return out


def service_seconds(timing: Mapping[str, float]) -> float | None:
    """The seconds to learn from a parsed server-timing: ``compute``, else ``total - queue``, else None."""
    compute = timing.get("compute")
    if compute is not None and compute > 0:
        return compute
    total = timing.get("total")
    if total is not None and total > 0:
        rest = total - timing.get("queue", 0.0)
        return rest if rest > 0 else None
    return None


def parse_orca(value: str) -> dict[str, float]:
    """An ORCA ``endpoint-load-metrics`` header as {key: value}; never raises.

    TEXT (``TEXT cpu_utilization=0.5, named_metrics.queue=3``) keeps its keys
    verbatim (``named_metrics.queue``); JSON is flattened to the same keys;
    BIN (serialised protobuf) is not read and gives {}.
    """
    out: dict[str, float] = {}
    if not value:
        return out
    text = value.strip()
    kind, _, rest = text.partition(" ")
    kind = kind.upper()
    if kind == "TEXT":
        for item in rest.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                continue
            try:
                number = float(raw.strip())
            except ValueError:
                continue
            if math.isfinite(number):
                out[key] = number
    elif kind == "JSON":
        try:
            doc = orjson.loads(rest)
        except orjson.JSONDecodeError:
            return out
        if isinstance(doc, dict):
            _flatten(doc, "", out)
    return out


def _flatten(doc: Mapping[str, object], prefix: str, out: dict[str, float]) -> None:
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif isinstance(value, Mapping):
            _flatten(value, f"{name}.", out)
