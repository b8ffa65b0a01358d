"""The hogs' closed loop through Envoy, and the fleet's token counter.

A hog client keeps ``concurrency`` large requests in flight: each one answered or refused is replaced at
once (a refused one after ``min(Retry-After, backoff_s)``: a client that ignores Retry-After turns the loop
into a storm of 429s that measures the client's CPU on a small host, not the balancer). Every hog's texts
are its own (a serial number picks them), so that no cache answers one.

Each 429 is sorted by what ext_proc's message says: refused at once on its predicted wait ("would come in
about"), or after waiting its maximum ("did not get its turn"), or another 429 (a quota).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

EARLY = "early_429"
WAITED = "waited_429"
OTHER_429 = "other_429"
OK = "ok"
ERROR = "error"  # another status, or no answer


@dataclass(frozen=True)
class HogAnswer:
    """One hog's end: when (``perf_counter``), its kind, its latency, and its tokens (if answered 200)."""

    ended: float
    kind: str
    seconds: float
    tokens: int


def kind_of(status: int | None, text: str) -> str:
    """What one answer was: OK, an early or waited 429 (by ext_proc's message), another 429, an error."""
    if status == 200:
        return OK
    if status == 429:
        if "would come in about" in text:
            return EARLY
        if "did not get its turn" in text:
            return WAITED
        return OTHER_429
    return ERROR


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


class HogLoop:
    """``concurrency`` hogs kept in flight against ``url`` until ``stop``; ``answers`` holds every end."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: Callable[[int], bytes], *, concurrency: int,
                 tokens_per_hog: int, headers: Mapping[str, str], backoff_s: float) -> None:
        self.client, self.url, self.body = client, url, body
        self.concurrency, self.tokens_per_hog, self.backoff_s = concurrency, tokens_per_hog, backoff_s
        self.headers = {"content-type": "application/json", **headers}
        self.answers: list[HogAnswer] = []
        self.serial = 0
        self.in_flight = 0
        self.cancelled = 0  # in flight when ``stop`` came
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._slot()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        """Stop replacing hogs and cancel the ones in flight (Envoy cancels them upstream)."""
        self._stopping = True
        self.cancelled = self.in_flight
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _slot(self) -> None:
        while not self._stopping:
            serial, self.serial = self.serial, self.serial + 1
            answer, pause = await self.once(serial)
            if answer.kind != OK and self.backoff_s > 0:
                await asyncio.sleep(min(pause if pause is not None else self.backoff_s, self.backoff_s))

    async def once(self, serial: int) -> tuple[HogAnswer, float | None]:
        """Hog number ``serial``, sent and recorded; with the Retry-After it was given, if any."""
        started = time.perf_counter()
        self.in_flight += 1
        try:
            response = await self.client.post(self.url, content=self.body(serial), headers=self.headers)
            status: int | None = response.status_code
            text, pause = response.text, _retry_after(response)
        except httpx.HTTPError:
            status, text, pause = None, "", None
        finally:
            self.in_flight -= 1
        ended = time.perf_counter()
        kind = kind_of(status, text)
        answer = HogAnswer(ended, kind, ended - started, self.tokens_per_hog if kind == OK else 0)
        self.answers.append(answer)
        return answer, pause

    def tokens_between(self, start: float, end: float) -> int:
        """Tokens of the hogs answered 200 within [start, end) (``perf_counter``)."""
        return sum(a.tokens for a in self.answers if start <= a.ended < end)


async def fleet_tokens(client: httpx.AsyncClient, urls: Sequence[str]) -> float:
    """Tokens the workers have embedded so far (their ``inferlb_worker_tokens_total``, summed): the fleet's
    work, counted as it is done rather than when a whole hog is answered."""
    return await worker_counters(client, urls, ("inferlb_worker_tokens_total",))


async def worker_counters(client: httpx.AsyncClient, urls: Sequence[str], names: Sequence[str]) -> float:
    """The sum over ``urls``' ``/metrics`` of the samples named ``names``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for url in urls:
        text = (await client.get(f"{url}/metrics")).text
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names)
    return total
