"""What ``inferlb bench hogs`` sends, and in which runs: the plan, its checks, the modes, the run list.

Kept apart from the live part so that the CLI can check its arguments (and exit 2 saying why) without
starting anything, and the tests can build plans and run lists without a stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.queue_order import SCHEDULINGS

# Where the hogs come from, and who sends the one-sentence requests beside them.
SAME_CLIENT = "same-client"  # hogs and sentences from one address (127.0.0.1), no key
OTHER_CLIENT = "other-client"  # hogs from another loopback address (127.0.0.2), no key
OTHER_TENANT = "other-tenant"  # hogs with one tenant's API key, sentences with another's
DIRECT = "direct"  # the hogs straight to the workers (issue 13's bench): only the sentences meet ext_proc
MODES = (SAME_CLIENT, OTHER_CLIENT, OTHER_TENANT, DIRECT)
ENVOY_MODES = (SAME_CLIENT, OTHER_CLIENT, OTHER_TENANT)
ORDERS = ("smallest", "fifo")  # ext_proc's fair_queue_order


@dataclass(frozen=True)
class HogsPlan:
    """What one run sends. Through Envoy: ``hog_concurrency`` hogs of ``hog_inputs`` x ``hog_tokens`` kept in
    flight (a closed loop), ``alone_s`` of hogs alone, then ``sentences`` one-sentence requests at
    ``rate_rps`` beside them. Direct: ``hogs_per_worker`` hogs sent once to each worker, then the sentences."""

    workers: int = 2
    hog_inputs: int = 32
    hog_tokens: int = 256
    hog_concurrency: int = 32
    inputs_per_worker: int = 2048  # direct mode only
    sentences: int = 120
    rate_rps: float = 10.0
    alone_s: float = 8.0
    ramp_s: float = 2.0  # hogs running before the hogs-alone window opens (the queue fills)
    hog_backoff_s: float = 1.0  # a refused hog waits min(Retry-After, this) before its replacement; 0: at once
    timeout_s: float = 300.0
    max_batch_tokens: int | None = None  # the workers' own default when None

    @property
    def hogs_per_worker(self) -> int:
        return self.inputs_per_worker // self.hog_inputs

    def problems(self, max_request_tokens: int, max_tokens: int = 256) -> list[str]:
        """Why this plan cannot run (empty when it can)."""
        out = []
        for name in ("workers", "hog_inputs", "hog_tokens", "hog_concurrency", "inputs_per_worker", "sentences"):
            if getattr(self, name) < 1:
                out.append(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.rate_rps > 0 or not self.timeout_s > 0 or not self.alone_s > 0:
            out.append("rate, alone-seconds and timeout must be > 0")
        if self.ramp_s < 0 or self.hog_backoff_s < 0:
            out.append("ramp and hog-backoff must be >= 0")
        if self.hog_tokens > max_tokens or self.hog_tokens < 3:
            out.append(f"hog-tokens must be 3..{max_tokens} (the model's limit), got {self.hog_tokens}")
        if self.hog_inputs * self.hog_tokens > max_request_tokens:
            out.append(f"a hog of {self.hog_inputs} x {self.hog_tokens} tokens is over the workers' "
                       f"max_request_tokens of {max_request_tokens}: they would refuse it")
        if self.inputs_per_worker < self.hog_inputs:
            out.append(f"inputs-per-worker ({self.inputs_per_worker}) is less than one hog ({self.hog_inputs})")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            out.append(f"max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        return out


@dataclass(frozen=True)
class RunSpec:
    """One run on a fresh stack: where the hogs come from, ext_proc's within-flow order, the workers'
    scheduling, and the round it belongs to."""

    mode: str
    order: str
    scheduling: str
    round: int = 1

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.order}:{self.scheduling}"

    @classmethod
    def from_name(cls, name: str, round: int) -> RunSpec:
        mode, order, scheduling = name.split(":")
        return cls(mode, order, scheduling, round)


def parse_list(option: str, text: str, known: tuple[str, ...]) -> list[str]:
    """A comma-separated list of ``known`` names, in the order given; ValueError naming ``option``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"{option} takes a comma-separated list of {', '.join(known)} (each once); got {text!r}")
    return names


def default_schedulings(modes: list[str]) -> list[str]:
    """las alone when any run goes through Envoy (issue 37 measures the door, with the workers' chosen
    scheduling); every option when only the direct mode runs (issue 13's comparison)."""
    return ["las"] if any(m in ENVOY_MODES for m in modes) else list(SCHEDULINGS)


def plan_runs(modes: list[str], orders: list[str], schedulings: list[str], rounds: int) -> list[RunSpec]:
    """Every run of the comparison, ``rounds`` times, each round rotated (``runner.plan_rounds``: no run
    always first). The direct mode runs once per scheduling, with the first order: its hogs never meet
    ext_proc's queue, so the order would change nothing there."""
    from ..routing.runner import ConfigurationPlan, plan_rounds

    specs = [RunSpec(mode, order, scheduling) for mode in modes for order in orders for scheduling in schedulings
             if mode != DIRECT or order == orders[0]]
    rotated = plan_rounds([ConfigurationPlan(s.name, ()) for s in specs], rounds)
    return [RunSpec.from_name(p.configuration, p.round) for p in rotated]
