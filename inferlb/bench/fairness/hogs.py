"""``inferlb bench hogs``: one-sentence requests while every worker holds the largest accepted requests.

Issue 13's hogs target: with the largest request a worker accepts (64 inputs of 256 tokens, its
``max_request_tokens``) in flight on every worker, as many concurrent copies as add up to 2,048 inputs
per worker, a one-sentence request's p99 is <= 100 ms. Measured for each worker scheduling option
(``workers/queue_order.py``: las, round_robin, fifo, the old batcher) side by side, each on a fresh
stack on loopback: real ONNX workers, the control plane, ext_proc and Envoy.

Per scheduling option:
1. the stack starts (``ProcessGroup``: everything is stopped on the way out, on errors and Ctrl-C too);
2. the hogs go straight to each worker (so each holds exactly its share), and the bench waits until
   every worker has queued all of their inputs;
3. one-sentence requests go through Envoy at a fixed rate (``loadgen.run_load``, open loop), a bounded
   count, while the hogs run; their p50/p99 and errors are the result;
4. the hogs are awaited (each bounded by ``--timeout``) and the stack stopped.
A run whose hogs had all finished before its last sentence was sent says so: its sentences did not all
meet a loaded worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from workers.queue_order import SCHEDULINGS

from ..report.table import ms

if TYPE_CHECKING:
    import httpx

    from ..load.loadgen import LoadOutcome
    from ..load.trace import Trace
    from ..processes import ProcessGroup

TARGET_P99_S = 0.100
SENTENCE_TOKENS = 16  # a one-sentence request, [CLS] and [SEP] included
WORKER_READY_TIMEOUT_S = 120.0

DESCRIPTION = """\
Issue 13's hogs benchmark. For each worker scheduling option (default las, round_robin, fifo) a fresh
stack on loopback (N real ONNX workers, control plane, ext_proc, Envoy): every worker gets as many
concurrent copies of the largest accepted request (64 inputs x 256 tokens) as add up to 2,048 inputs,
straight to the worker; meanwhile one-sentence requests go through Envoy at a modest fixed rate. Prints
the sentences' p50/p99 and errors per option side by side (target: p99 <= 100 ms with las), and how long
the hogs took. Takes about 2 minutes per option; --quick about 30 s."""

EPILOG = """\
examples:
  inferlb bench hogs                               las, round_robin and fifo, 2 workers
  inferlb bench hogs --schedulings las --quick
  inferlb bench hogs --max-batch-tokens 256 --json /tmp/hogs.json"""


@dataclass(frozen=True)
class HogsPlan:
    """What one run sends: ``hogs_per_worker`` requests of ``hog_inputs`` x ``hog_tokens`` to each worker,
    and ``sentences`` one-sentence requests at ``rate_rps`` through the data plane."""

    workers: int = 2
    hog_inputs: int = 64
    hog_tokens: int = 256
    inputs_per_worker: int = 2048
    sentences: int = 100
    rate_rps: float = 5.0
    timeout_s: float = 300.0
    max_batch_tokens: int | None = None  # the workers' own default when None

    @property
    def hogs_per_worker(self) -> int:
        return self.inputs_per_worker // self.hog_inputs

    def problems(self, max_request_tokens: int, max_tokens: int = 256) -> list[str]:
        """Why this plan cannot run (empty when it can)."""
        out = []
        for name in ("workers", "hog_inputs", "hog_tokens", "inputs_per_worker", "sentences"):
            if getattr(self, name) < 1:
                out.append(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.rate_rps > 0 or not self.timeout_s > 0:
            out.append("rate and timeout must be > 0")
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


QUICK = {"inputs_per_worker": 512, "sentences": 30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = HogsPlan()
    parser.add_argument("--schedulings", default=",".join(SCHEDULINGS), metavar="LIST",
                        help=f"worker scheduling options to compare, in order (default {','.join(SCHEDULINGS)})")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"real ONNX workers (default {d.workers})")
    parser.add_argument("--hog-inputs", type=int, default=d.hog_inputs, help=f"inputs per hog (default {d.hog_inputs})")
    parser.add_argument("--hog-tokens", type=int, default=d.hog_tokens,
                        help=f"tokens per hog input (default {d.hog_tokens}, the model's limit)")
    parser.add_argument("--inputs-per-worker", type=int, metavar="N",
                        help=f"hog inputs in flight on each worker (default {d.inputs_per_worker}; "
                             f"--quick {QUICK['inputs_per_worker']})")
    parser.add_argument("--sentences", type=int, metavar="N",
                        help=f"one-sentence requests per option (default {d.sentences}; --quick {QUICK['sentences']})")
    parser.add_argument("--rate", type=float, default=d.rate_rps, metavar="RPS",
                        help=f"one-sentence requests per second (default {d.rate_rps:g})")
    parser.add_argument("--max-batch-tokens", type=int, metavar="N",
                        help="the workers' --max-batch-tokens (default: the workers' own default)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                        help=f"per-request timeout, Envoy's route timeout too (default {d.timeout_s:g})")
    parser.add_argument("--quick", action="store_true", help="fewer hog inputs per worker and fewer sentences")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/hogs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def plan_from_args(args: argparse.Namespace) -> HogsPlan:
    quick = QUICK if args.quick else {}
    d = HogsPlan()
    return HogsPlan(
        workers=args.workers, hog_inputs=args.hog_inputs, hog_tokens=args.hog_tokens,
        inputs_per_worker=args.inputs_per_worker or quick.get("inputs_per_worker", d.inputs_per_worker),
        sentences=args.sentences or quick.get("sentences", d.sentences), rate_rps=args.rate,
        timeout_s=args.timeout, max_batch_tokens=args.max_batch_tokens)


def parse_schedulings(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULINGS]
    if not names or unknown:
        raise ValueError(f"--schedulings takes a comma-separated list of {', '.join(SCHEDULINGS)}; "
                         f"got {text!r}")
    return names


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- one run --------------------------------------------------------------------------------------------


def worker_components(plan: HogsPlan, scheduling: str, ports: Sequence[int], log_dir: Path,
                      data_dir: Path) -> list[Any]:
    """Real ONNX workers, one intra-op thread each, with ``scheduling``, their per-input cache off: every hog is
    the same text, which the cache would compute once for all of them (coalescing), so nothing would queue."""
    from ...supervisor import Component
    from ..stack.fleet import FLEET_GROUP, HOST, child_env

    extra = ["--cache-max-bytes", "0"]
    if plan.max_batch_tokens:
        extra += ["--max-batch-tokens", str(plan.max_batch_tokens)]
    env = child_env({"INFERLB_DATA_DIR": str(data_dir)})
    return [Component(name=f"worker:{port}",
                      argv=[sys.executable, "-m", "workers", "--host", HOST, "--port", str(port), "--threads", "1",
                            "--scheduling", scheduling, "--log-level", "warning", *extra],
                      ready_url=f"http://{HOST}:{port}/readyz", log_path=log_dir / f"worker-{port}.log", env=env,
                      ready_timeout_s=WORKER_READY_TIMEOUT_S, group=FLEET_GROUP)
            for port in ports]


async def _received_inputs(client: httpx.AsyncClient, url: str) -> float:
    """Inputs the worker has embedded or queued (``inputs_total`` + ``queue_depth``): a hog counts once it is
    tokenised and queued, not merely received. The batch computing now is in neither (at most
    ``max_batch_size`` inputs)."""
    from prometheus_client.parser import text_string_to_metric_families

    from ..stack.fleet import QUEUE_METRIC

    text = (await client.get(f"{url}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in (QUEUE_METRIC, "inferlb_worker_inputs_total"))


async def _done_after(tasks: Sequence[asyncio.Task[Any]], seconds: float) -> int:
    """How many of ``tasks`` are done ``seconds`` from now."""
    await asyncio.sleep(seconds)
    return sum(t.done() for t in tasks)


async def _post_hog(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[int | None, float]:
    import httpx

    started = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/embeddings", content=body,
                                     headers={"content-type": "application/json"})
        status: int | None = response.status_code
    except httpx.HTTPError:
        status = None
    return status, time.perf_counter() - started


async def run_one(plan: HogsPlan, scheduling: str, out: Path, data_dir: Path, progress: bool) -> dict[str, Any]:
    """One scheduling option on a fresh stack: its sentences' figures and its hogs'."""
    import httpx

    from workers.config import WorkerConfig

    from ..stack.dataplanes import DataPlanePorts, plan_data_plane
    from ..stack.dataplanes.launch import start_data_plane
    from ..stack.fleet import HOST
    from ..load.loadgen import run_load
    from ..processes import ProcessGroup, free_ports
    from ..routing.runner import find_envoy
    from ..load.texts import embeddings_body

    workdir = out / scheduling
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    ports = free_ports(plan.workers)
    urls = [f"http://{HOST}:{port}" for port in ports]
    data_plane = plan_data_plane("inferlb_ext_proc", endpoints=[(HOST, p) for p in ports], workdir=workdir,
                                 ports=DataPlanePorts.allocate(), request_timeout_s=plan.timeout_s,
                                 envoy=find_envoy())
    hog_body = embeddings_body(plan.hog_tokens, 0, inputs=plan.hog_inputs)
    trace, sentence_bodies = _sentences(plan)
    hogs = plan.hogs_per_worker
    limits = httpx.Limits(max_connections=hogs * plan.workers + 8, max_keepalive_connections=hogs * plan.workers + 8)
    async with ProcessGroup(report=lambda line: None) as group, \
            httpx.AsyncClient(timeout=plan.timeout_s, limits=limits, trust_env=False) as client:
        started = time.monotonic()
        await group.start(worker_components(plan, scheduling, ports, workdir / "logs", data_dir))
        await start_data_plane(data_plane, group, client, [f"{HOST}:{p}" for p in ports])
        _report(f"  {scheduling}: {plan.workers} workers + control plane, ext_proc, Envoy ready in "
                f"{time.monotonic() - started:.1f}s")
        warm = await client.post(data_plane.url, content=sentence_bodies[0],
                                 headers={"content-type": "application/json"})
        if warm.status_code != 200:
            raise RuntimeError(f"a first sentence through Envoy got {warm.status_code}: {warm.text[:200]}")
        before = [await _received_inputs(client, url) for url in urls]
        hog_started = time.perf_counter()
        tasks = [asyncio.create_task(_post_hog(client, url, hog_body)) for url in urls for _ in range(hogs)]
        try:
            queued = hogs * plan.hog_inputs - WorkerConfig().max_batch_size  # all but the batch computing now
            await _until_queued(client, urls, before, queued, tasks, group)
            _report(f"  {scheduling}: {hogs} hogs of {plan.hog_inputs} x {plan.hog_tokens} tokens queued on "
                    f"each worker; {plan.sentences} sentences at {plan.rate_rps:g}/s through Envoy")
            done_at_last_send = asyncio.create_task(_done_after(tasks, float(trace.send_at_s[-1])))
            outcome = await run_load(data_plane.url, trace, sentence_bodies, slo_s=TARGET_P99_S,
                                     timeout_s=plan.timeout_s, progress=progress)
            hogs_done_early = await done_at_last_send
            results = await asyncio.wait_for(asyncio.gather(*tasks), plan.timeout_s + 10)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        group.check_alive()
    figures = _figures(scheduling, outcome, results, hogs_done_early, hog_started)
    _report(f"    sentences p50 {ms(figures['sentence_p50_s'])} ms, p99 {ms(figures['sentence_p99_s'])} ms, "
            f"errors {figures['sentence_errors']}; hogs {figures['hogs_ok']}/{figures['hogs']} ok in "
            f"{figures['hog_makespan_s']} s")
    return figures


def _sentences(plan: HogsPlan) -> tuple[Trace, list[bytes]]:
    """The one-sentence requests: evenly spaced at the plan's rate, each with its own text."""
    import numpy as np

    from ..load.texts import embeddings_body
    from ..load.trace import Trace

    n = plan.sentences
    trace = Trace(np.arange(n, dtype=np.float64) / plan.rate_rps, np.full(n, SENTENCE_TOKENS, dtype=np.int64),
                  np.zeros(n, dtype=np.int64), plan.rate_rps, n / plan.rate_rps, 0)
    return trace, [embeddings_body(SENTENCE_TOKENS, i % 16) for i in range(n)]


async def _until_queued(client: httpx.AsyncClient, urls: list[str], before: list[int], queued: int,
                        tasks: list[asyncio.Task[tuple[int | None, float]]], group: ProcessGroup) -> None:
    """Wait until every worker has received ``queued`` more inputs (the hogs wait in its queue); raise when a
    hog was refused, a process died, or after 60 s."""
    deadline = time.monotonic() + 60
    while not all([await _received_inputs(client, url) - b >= queued for url, b in zip(urls, before)]):
        group.check_alive()
        failed = [t.result()[0] for t in tasks if t.done() and t.result()[0] != 200]
        if failed:
            raise RuntimeError(f"a hog was answered {failed[0]} (see the worker logs)")
        if time.monotonic() > deadline:
            raise RuntimeError("the hogs were not all queued within 60 s (see the worker logs)")
        await asyncio.sleep(0.05)


def _figures(scheduling: str, outcome: LoadOutcome, results: list[tuple[int | None, float]], hogs_done_early: int,
             hog_started: float) -> dict[str, Any]:
    """One scheduling option's row: the sentences' latency and errors, the hogs' completions and makespan."""
    import numpy as np

    s = outcome.histogram.summary()
    ok = [seconds for status, seconds in results if status == 200]
    figures = {
        "scheduling": scheduling,
        "sentences_sent": outcome.sent, "sentences_completed": outcome.completed,
        "sentence_errors": outcome.errors + outcome.timeouts,
        "sentence_statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
        "sentence_p50_s": s.p50_s if outcome.completed else None,
        "sentence_p99_s": s.p99_s if outcome.completed else None,
        "sentence_max_s": s.max_s if outcome.completed else None,
        "sentences_clamped_at_60s": outcome.histogram.clamped,
        "hogs": len(results), "hogs_ok": len(ok), "hogs_done_at_last_sentence_sent": hogs_done_early,
        "hog_makespan_s": round(time.perf_counter() - hog_started, 2) if ok else None,
        "hog_p50_s": float(np.percentile(ok, 50)) if ok else None,
    }
    return figures


# --- output ---------------------------------------------------------------------------------------------


def verdict(run: dict[str, Any]) -> str:
    p99 = run["sentence_p99_s"]
    if run["hogs_done_at_last_sentence_sent"] >= run["hogs"]:
        return "INVALID (every hog had ended before the last sentence was sent)"
    if p99 is None or run["sentence_errors"]:
        return "MISSED (errors)"
    return "met" if p99 <= TARGET_P99_S else "MISSED"


def render(report: dict[str, Any]) -> str:
    plan = report["plan"]
    lines = [f"hogs: {plan['workers']} workers, each with {plan['inputs_per_worker'] // plan['hog_inputs']} hogs of "
             f"{plan['hog_inputs']} x {plan['hog_tokens']} tokens; {plan['sentences']} one-sentence requests at "
             f"{plan['rate_rps']:g}/s through Envoy; max_batch_tokens "
             f"{plan['max_batch_tokens'] or 'default'}",
             "",
             "| scheduling | sentences | p50 ms | p99 ms | max ms | errors | hogs ok | hogs' makespan s | "
             f"p99 <= {TARGET_P99_S * 1e3:.0f} ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        lines.append(f"| {run['scheduling']} | {run['sentences_completed']}/{run['sentences_sent']} | "
                     f"{ms(run['sentence_p50_s'])} | {ms(run['sentence_p99_s'])} | {ms(run['sentence_max_s'])} | "
                     f"{run['sentence_errors']} | {run['hogs_ok']}/{run['hogs']} | {run['hog_makespan_s']} | "
                     f"{verdict(run)} |")
    for failure in report["failures"]:
        lines.append(f"| {failure['scheduling']} | FAILED: {failure['error']} |")
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"inferlb bench hogs: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from workers.config import WorkerConfig, default_data_dir

    from ..stack.dataplanes.launch import DataPlaneError
    from ..processes import ComponentDied
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy

    try:
        schedulings = parse_schedulings(args.schedulings)
    except ValueError as exc:
        return _fail(str(exc))
    plan = plan_from_args(args)
    problems = plan.problems(WorkerConfig().max_request_tokens)
    if problems:
        return _fail("; ".join(problems))
    if missing_envoy("inferlb bench hogs"):
        return 1
    data_dir = default_data_dir()
    out = (args.out or Path("bench-results") / "hogs").resolve()
    _report(f"hogs: {', '.join(schedulings)} in turn, each on a fresh stack; model from {data_dir}; logs in {out}")
    report: dict[str, Any] = {"plan": asdict(plan), "target_p99_s": TARGET_P99_S, "runs": [], "failures": []}
    started = time.monotonic()
    for index, scheduling in enumerate(schedulings, 1):
        _report(f"[{index}/{len(schedulings)}] scheduling {scheduling}")
        try:
            report["runs"].append(run_on_uvloop(run_one(plan, scheduling, out, data_dir, not args.no_progress)))
        except KeyboardInterrupt:
            print("interrupted; every process stopped", file=sys.stderr)
            return 130
        except (DataPlaneError, ComponentDied, RuntimeError, TimeoutError, OSError) as exc:
            _report(f"  FAILED: {scheduling}: {exc}")
            report["failures"].append({"scheduling": scheduling, "error": str(exc)})
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0
