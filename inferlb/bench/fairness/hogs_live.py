"""One run of ``inferlb bench hogs`` on a fresh stack: real ONNX workers, the control plane, ext_proc (with
the run's ``fair_queue_order``) and Envoy, all in one ``ProcessGroup`` (stopped on the way out, on errors
and Ctrl-C too).

Through Envoy (same-client, other-client, other-tenant): the hogs' closed loop starts; after ``ramp_s`` the
fleet's tokens are counted for ``alone_s`` (hogs alone); then the sentences go through Envoy open loop
(``loadgen.run_load``, latency from each one's scheduled send) while the fleet's tokens are counted again.
Direct: issue 13's run, the hogs straight to the workers until every worker has queued them, then the
sentences.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..load.loadgen import LoadOutcome, run_load
from ..load.texts import embeddings_body
from ..load.trace import Trace
from ..processes import ProcessGroup
from ..stack.dataplanes import DataPlanePlan
from .hogs_load import HogAnswer, HogLoop, fleet_tokens, worker_counters
from .hogs_plan import OTHER_CLIENT, OTHER_TENANT, HogsPlan, RunSpec

SENTENCE_TOKENS = 16  # a one-sentence request, [CLS] and [SEP] included
SENTENCE_VARIANTS = 10**9  # the sentences' texts: variants far from any hog's (unique, no cache answers)
WORKER_READY_TIMEOUT_S = 120.0
KEYS_TIMEOUT_S = 30.0
ORDER_ENV = "INFERLB_EXT_PROC_FAIR_QUEUE_ORDER"
HOG_ADDRESS = {OTHER_CLIENT: "127.0.0.2"}  # the hogs' source address; 127.0.0.1 otherwise
TENANTS = ("hogs", "sentences")
Report = Callable[[str], None]


@dataclass
class Measured:
    """What one run measured, before it is summed up (``hogs_report.figures``)."""

    spec: RunSpec
    sentences: LoadOutcome
    hogs: list[HogAnswer]
    windows: dict[str, tuple[float, float]]  # phase -> (start, end), perf_counter
    fleet_tokens: dict[str, float]  # phase -> tokens the workers embedded in it
    hogs_cancelled: int = 0  # in flight when the run ended (not in ``hogs``)
    hogs_done_at_last_sentence_sent: int | None = None  # direct mode
    hog_makespan_s: float | None = None  # direct mode


def worker_components(plan: HogsPlan, scheduling: str, ports: Sequence[int], log_dir: Path,
                      data_dir: Path) -> list[Any]:
    """Real ONNX workers, one intra-op thread each, with ``scheduling`` and their own cache settings (as
    ``make up`` runs them): every input the bench sends is unique, so their cache never answers."""
    from ...supervisor import Component
    from ..stack.fleet import FLEET_GROUP, HOST, child_env

    extra = ["--max-batch-tokens", str(plan.max_batch_tokens)] if plan.max_batch_tokens else []
    env = child_env({"INFERLB_DATA_DIR": str(data_dir)})
    return [Component(name=f"worker:{port}",
                      argv=[sys.executable, "-m", "workers", "--host", HOST, "--port", str(port), "--threads", "1",
                            "--scheduling", scheduling, "--log-level", "warning", *extra],
                      ready_url=f"http://{HOST}:{port}/readyz", log_path=log_dir / f"worker-{port}.log", env=env,
                      ready_timeout_s=WORKER_READY_TIMEOUT_S, group=FLEET_GROUP)
            for port in ports]


def sentences(plan: HogsPlan) -> tuple[Trace, list[bytes]]:
    """The one-sentence requests: evenly spaced at the plan's rate, each text its own."""
    import numpy as np

    n = plan.sentences
    trace = Trace(np.arange(n, dtype=np.float64) / plan.rate_rps, np.full(n, SENTENCE_TOKENS, dtype=np.int64),
                  np.zeros(n, dtype=np.int64), plan.rate_rps, n / plan.rate_rps, 0)
    return trace, [embeddings_body(SENTENCE_TOKENS, SENTENCE_VARIANTS + 1 + i) for i in range(n)]


def hog_body(plan: HogsPlan) -> Callable[[int], bytes]:
    """Hog number ``serial``'s body: ``hog_inputs`` texts no other hog (or sentence) has."""
    return lambda serial: embeddings_body(plan.hog_tokens, serial, inputs=plan.hog_inputs)


@asynccontextmanager
async def stack(plan: HogsPlan, spec: RunSpec, out: Path, data_dir: Path,
                report: Report) -> AsyncIterator[tuple[ProcessGroup, httpx.AsyncClient, DataPlanePlan, list[str]]]:
    """The run's stack, started and ready, a first sentence answered through Envoy; stopped on the way out."""
    from ..processes import free_ports
    from ..routing.runner import find_envoy
    from ..stack.dataplanes import DataPlanePorts, plan_data_plane
    from ..stack.dataplanes.launch import start_data_plane
    from ..stack.fleet import HOST
    from .fair_live import with_ext_proc_env

    workdir = out / f"round{spec.round}-{spec.mode}-{spec.order}-{spec.scheduling}"
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    ports = free_ports(plan.workers)
    dp = plan_data_plane("inferlb_ext_proc", endpoints=[(HOST, p) for p in ports], workdir=workdir,
                         ports=DataPlanePorts.allocate(), request_timeout_s=plan.timeout_s, envoy=find_envoy())
    dp = with_ext_proc_env(dp, {ORDER_ENV: spec.order})
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with ProcessGroup(report=lambda line: None) as group, \
            httpx.AsyncClient(timeout=plan.timeout_s, limits=limits, trust_env=False) as client:
        started = time.monotonic()
        await group.start(worker_components(plan, spec.scheduling, ports, workdir / "logs", data_dir))
        await start_data_plane(dp, group, client, [f"{HOST}:{p}" for p in ports])
        report(f"  {plan.workers} workers ({spec.scheduling}) + control plane, ext_proc (order {spec.order}), "
               f"Envoy ready in {time.monotonic() - started:.1f}s")
        warm = await client.post(dp.url, content=embeddings_body(SENTENCE_TOKENS, SENTENCE_VARIANTS),
                                 headers={"content-type": "application/json"})
        if warm.status_code != 200:
            raise RuntimeError(f"a first sentence through Envoy got {warm.status_code}: {warm.text[:200]}")
        yield group, client, dp, [f"http://{HOST}:{p}" for p in ports]
        group.check_alive()


async def tenant_keys(client: httpx.AsyncClient, group: ProcessGroup, dp: DataPlanePlan) -> dict[str, str]:
    """An API key per tenant (hogs, sentences) through the admin API, once ext_proc knows each: a probe
    with it is answered 200 through Envoy (an unknown key is refused)."""
    from ..ext_proc_bench.stack import wait_until
    from ..quota.quota_accuracy_stack import create_key

    assert dp.control_plane_url is not None and dp.admin_token is not None
    keys = {t: await create_key(client, dp.control_plane_url, dp.admin_token, {"tenant": t}) for t in TENANTS}
    for tenant, key in keys.items():
        async def answered(key: str = key) -> bool:
            response = await client.post(dp.url, content=embeddings_body(SENTENCE_TOKENS, SENTENCE_VARIANTS),
                                         headers={"content-type": "application/json",
                                                  "authorization": f"Bearer {key}"})
            return response.status_code == 200

        await wait_until(answered, KEYS_TIMEOUT_S, f"ext_proc to know tenant {tenant}'s key", group)
    return keys


async def run_envoy(plan: HogsPlan, spec: RunSpec, out: Path, data_dir: Path, progress: bool,
                    report: Report) -> Measured:
    """One Envoy mode: hogs alone, then hogs and sentences (see the module's docstring)."""
    async with stack(plan, spec, out, data_dir, report) as (group, client, dp, urls):
        hog_headers: Mapping[str, str] = {}
        sentence_headers: Mapping[str, str] = {}
        if spec.mode == OTHER_TENANT:
            keys = await tenant_keys(client, group, dp)
            hog_headers = {"authorization": f"Bearer {keys['hogs']}"}
            sentence_headers = {"authorization": f"Bearer {keys['sentences']}"}
        transport = httpx.AsyncHTTPTransport(
            local_address=HOG_ADDRESS.get(spec.mode, "127.0.0.1"),
            limits=httpx.Limits(max_connections=plan.hog_concurrency, max_keepalive_connections=plan.hog_concurrency))
        async with httpx.AsyncClient(transport=transport, timeout=plan.timeout_s, trust_env=False) as hog_client:
            loop = HogLoop(hog_client, dp.url, hog_body(plan), concurrency=plan.hog_concurrency,
                           tokens_per_hog=plan.hog_inputs * plan.hog_tokens, headers=hog_headers,
                           backoff_s=plan.hog_backoff_s)
            trace, bodies = sentences(plan)
            loop.start()
            try:
                await asyncio.sleep(plan.ramp_s)  # the queue fills before the window opens
                group.check_alive()
                marks = [(time.perf_counter(), await fleet_tokens(client, urls))]
                await asyncio.sleep(plan.alone_s)
                marks.append((time.perf_counter(), await fleet_tokens(client, urls)))
                report(f"  hogs alone for {plan.alone_s:g} s ({loop.serial} sent so far); now {plan.sentences} "
                       f"sentences at {plan.rate_rps:g}/s beside them")
                outcome = await run_load(dp.url, trace, bodies, slo_s=0.1, timeout_s=plan.timeout_s,
                                         progress=progress, headers=sentence_headers)
                marks.append((time.perf_counter(), await fleet_tokens(client, urls)))
            finally:
                await loop.stop()
    return Measured(spec, outcome, loop.answers, hogs_cancelled=loop.cancelled,
                    windows={"alone": (marks[0][0], marks[1][0]), "with_sentences": (marks[1][0], marks[2][0])},
                    fleet_tokens={"alone": marks[1][1] - marks[0][1], "with_sentences": marks[2][1] - marks[1][1]})


async def run_direct(plan: HogsPlan, spec: RunSpec, out: Path, data_dir: Path, progress: bool,
                     report: Report) -> Measured:
    """Issue 13's run: ``hogs_per_worker`` hogs straight to each worker, queued, then the sentences."""
    from workers.config import WorkerConfig

    async with stack(plan, spec, out, data_dir, report) as (group, client, dp, urls):
        trace, bodies = sentences(plan)
        body = hog_body(plan)
        hogs = plan.hogs_per_worker
        before = [await worker_counters(client, [url], _RECEIVED) for url in urls]
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=hogs * plan.workers))
        async with httpx.AsyncClient(transport=transport, timeout=plan.timeout_s, trust_env=False) as hog_client:
            hog_started = time.perf_counter()
            loops = [HogLoop(hog_client, f"{url}/v1/embeddings", lambda n, k=k: body(k * hogs + n), concurrency=0,
                             tokens_per_hog=plan.hog_inputs * plan.hog_tokens, headers={}, backoff_s=0)
                     for k, url in enumerate(urls)]
            tasks = [asyncio.create_task(loop.once(n)) for loop in loops for n in range(hogs)]
            try:
                queued = hogs * plan.hog_inputs - WorkerConfig().max_batch_size  # all but the batch computing now
                await _until_queued(client, urls, before, queued, loops, group)
                report(f"  {hogs} hogs of {plan.hog_inputs} x {plan.hog_tokens} tokens queued on each worker; "
                       f"{plan.sentences} sentences at {plan.rate_rps:g}/s through Envoy")
                start = time.perf_counter()
                outcome = await run_load(dp.url, trace, bodies, slo_s=0.1, timeout_s=plan.timeout_s,
                                         progress=progress)
                last_sent = start + float(trace.send_at_s[-1])
                await asyncio.wait_for(asyncio.gather(*tasks), plan.timeout_s + 10)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    answers = [a for loop in loops for a in loop.answers]
    return Measured(spec, outcome, answers, windows={}, fleet_tokens={},
                    hogs_done_at_last_sentence_sent=sum(a.ended <= last_sent for a in answers),
                    hog_makespan_s=round(max(a.ended for a in answers) - hog_started, 2) if answers else None)


_RECEIVED = ("inferlb_worker_queue_depth", "inferlb_worker_inputs_total")


async def _until_queued(client: httpx.AsyncClient, urls: list[str], before: list[float], queued: int,
                        loops: list[HogLoop], group: ProcessGroup) -> None:
    """Until every worker has embedded or queued ``queued`` more inputs (the hogs wait in its queue); raise
    when a hog was refused, a process died, or after 60 s."""
    deadline = time.monotonic() + 60
    while not all([await worker_counters(client, [url], _RECEIVED) - b >= queued for url, b in zip(urls, before)]):
        group.check_alive()
        failed = [a.kind for loop in loops for a in loop.answers if a.kind != "ok"]
        if failed:
            raise RuntimeError(f"a hog was answered {failed[0]} (see the worker logs)")
        if time.monotonic() > deadline:
            raise RuntimeError("the hogs were not all queued within 60 s (see the worker logs)")
        await asyncio.sleep(0.05)
