"""The accuracy bench's clients: one tenant's open-loop load, played to ext_proc as Envoy plays it.

Each client has its own gRPC channel to one ext_proc replica and its own
Poisson schedule; together they offer ``load`` times the tenant's tokens per
minute. A request is one ext_proc stream with Envoy's messages: the request
headers (with ``authorization: Bearer <key>``), the buffered body, and, when
ext_proc let it through, the response headers of a 200 (what Envoy sends
after the worker answered). Nothing reaches a worker: the bench is about the
quota, and the answers say everything (a 429 is an ImmediateResponse; an
admitted request's body answer carries ext_proc's own token count,
``x-inferlb-tokens``, and its response-headers answer the tokens window's
``x-ratelimit-reset-tokens``).

Bodies are real OpenAI embeddings requests whose token count is exact by
construction (``texts.text_with_tokens``: one to ``sentences`` texts of a
drawn length each), so the tokens offered are known without a tokenizer and
ext_proc's count of every admitted request is checked against them.

Which window a decision fell in is Redis's (``TIME // 60 s``, as the quota
script computes it): the bench reads Redis's clock once and maps its own
monotonic clock onto it. An admitted request's ``x-ratelimit-reset-tokens``
is ``2 x 60 s - elapsed`` at the decision (the window holds its tokens), so
its window is exact even when the stream straddles a boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..ext_proc_bench.grpc_load import PROCESS_METHOD, header_map
from ..load.texts import MODEL, VARIANTS, text_with_tokens

WINDOW_MS = 60_000  # the quota algorithm's window (ext_proc.quota.algorithm.WINDOW_MS)
PATH = "/v1/embeddings"
TOKENS_HEADER = "x-inferlb-tokens"
RESET_TOKENS_HEADER = "x-ratelimit-reset-tokens"
RATE_LIMITED_DETAILS = "inferlb_rate_limit_exceeded"
STREAM_TIMEOUT_S = 30.0  # one request's ext_proc stream, at most
LATE_LIMIT_S = 30.0  # a schedule more than this behind is abandoned (the rest counted as not sent)
MAX_IN_FLIGHT = 256  # per client; more is counted as dropped rather than queued without bound
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a client's schedule."""

    at_s: float  # after the load's start
    tokens: int  # exact, by construction
    body: bytes


@dataclass(slots=True)
class Sent:
    """What became of one request."""

    client: int
    tokens: int
    sent_ms: float  # Redis's clock
    done_ms: float = math.nan
    outcome: str = "lost"  # admitted, rate_limited, or what else answered ("503 inferlb_no_endpoint_ready")
    counted: int | None = None  # ext_proc's x-inferlb-tokens
    reset_ms: int | None = None  # ext_proc's x-ratelimit-reset-tokens, in ms
    picked: bool = False

    @property
    def decision_window(self) -> int:
        """The Redis window the quota check ran in (an admitted one's reset time pins it down)."""
        middle = (self.sent_ms + self.done_ms) / 2
        if self.reset_ms is None:
            return int(middle // WINDOW_MS)
        elapsed = 2 * WINDOW_MS - self.reset_ms
        return round((middle - elapsed) / WINDOW_MS)


def requests_per_s(tokens_per_minute: int, load: float, sentences: tuple[int, int],
                   sentence_tokens: tuple[int, int]) -> float:
    """The request rate that offers ``load`` x ``tokens_per_minute`` with these sizes (uniform draws)."""
    mean_tokens = (sentences[0] + sentences[1]) / 2 * (sentence_tokens[0] + sentence_tokens[1]) / 2
    return load * tokens_per_minute / 60 / mean_tokens


def plan_load(tokens_per_minute: int, load: float, seconds: float, clients: int, sentences: tuple[int, int],
              sentence_tokens: tuple[int, int], seed: int) -> list[list[Planned]]:
    """Each client's schedule: Poisson arrivals offering ``load`` x ``tokens_per_minute`` in all."""
    per_client = requests_per_s(tokens_per_minute, load, sentences, sentence_tokens) / clients
    if per_client * clients * seconds > MAX_REQUESTS:
        raise ValueError(f"about {per_client * clients * seconds:.0f} requests: at most {MAX_REQUESTS:,}")
    texts: dict[tuple[int, int], str] = {}

    def text(tokens: int, variant: int) -> str:
        found = texts.get((tokens, variant))
        if found is None:
            found = texts[(tokens, variant)] = text_with_tokens(tokens, variant)
        return found

    schedules = []
    for client in range(clients):
        rng = random.Random(seed * 1_000_003 + client)
        at, planned = rng.expovariate(per_client), []
        while at < seconds:
            lengths = [rng.randint(*sentence_tokens) for _ in range(rng.randint(*sentences))]
            body = orjson.dumps({"model": MODEL, "input": [text(n, rng.randrange(VARIANTS)) for n in lengths]})
            planned.append(Planned(at, sum(lengths), body))
            at += rng.expovariate(per_client)
        schedules.append(planned)
    return schedules


def duration_ms(text: str) -> int:
    """An OpenAI reset duration (``250ms``, ``59.5s``, ``1m23.456s``, ``1h0m0s``) in milliseconds."""
    if text.endswith("ms") and text[:-2].isdigit():
        return int(text[:-2])
    match = _DURATION.fullmatch(text)
    if match is None or not text:
        raise ValueError(f"not a reset duration: {text!r}")
    hours, minutes, seconds = match.groups()
    return round((int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)) * 1000)


_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")


class RedisClock:
    """Redis's clock in milliseconds, read once and followed on this process's monotonic clock."""

    def __init__(self, redis_ms: float, monotonic_s: float) -> None:
        self._base_ms = redis_ms - monotonic_s * 1000

    @classmethod
    async def read(cls, redis: Any) -> RedisClock:
        """From one ``TIME`` (taken as read half-way through the round trip)."""
        before = time.monotonic()
        seconds, micros = await redis.time()
        return cls(seconds * 1000 + micros / 1000, (before + time.monotonic()) / 2)

    def now_ms(self) -> float:
        return self._base_ms + time.monotonic() * 1000

    def at_ms(self, monotonic_s: float) -> float:
        return self._base_ms + monotonic_s * 1000

    def monotonic_at(self, redis_ms: float) -> float:
        return (redis_ms - self._base_ms) / 1000


class Requests:
    """Plays one request as Envoy would on a gRPC channel to one replica."""

    def __init__(self, channel: Any, key: str, clock: RedisClock, pick_header: str) -> None:
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        self._pb = pb
        self._process = channel.stream_stream(PROCESS_METHOD, request_serializer=None, response_deserializer=None)
        self._key = key
        self._clock = clock
        self._pick_header = pick_header
        self._response = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(
            [(":status", "200"), ("content-type", "application/json")]))).SerializeToString()

    def _headers(self, body: bytes) -> bytes:
        pb = self._pb
        return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map([
            (":authority", "inferlb"), (":path", PATH), (":method", "POST"), (":scheme", "http"),
            ("content-type", "application/json"), ("content-length", str(len(body))),
            ("authorization", f"Bearer {self._key}"), ("user-agent", "inferlb-bench-quota-accuracy")]))
        ).SerializeToString()

    async def send(self, sent: Sent, body: bytes) -> Sent:
        """One stream; fills in ``sent`` (never raises for what ext_proc or gRPC answer)."""
        import grpc

        pb = self._pb
        call = self._process(timeout=STREAM_TIMEOUT_S)
        try:
            await call.write(self._headers(body))
            answer = pb.ProcessingResponse.FromString(await call.read())
            if answer.HasField("request_headers"):
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
                                 .SerializeToString())
                answer = pb.ProcessingResponse.FromString(await call.read())
            sent.done_ms = self._clock.now_ms()
            if answer.HasField("immediate_response"):
                reply = answer.immediate_response
                sent.outcome = ("rate_limited" if reply.details == RATE_LIMITED_DETAILS
                                else f"{reply.status.code} {reply.details}")
            elif answer.HasField("request_body"):
                headers = _set_headers(answer.request_body.response.header_mutation)
                sent.outcome = "admitted"
                sent.picked = self._pick_header in headers
                sent.counted = int(headers[TOKENS_HEADER]) if TOKENS_HEADER in headers else None
                await call.write(self._response)
                answer = pb.ProcessingResponse.FromString(await call.read())
                reset = _set_headers(answer.response_headers.response.header_mutation).get(RESET_TOKENS_HEADER)
                sent.reset_ms = duration_ms(reset) if reset is not None else None
            else:
                sent.outcome = f"unexpected answer {answer.WhichOneof('response')}"
            await call.done_writing()
            await call.code()
        except grpc.aio.AioRpcError as exc:
            sent.outcome = f"grpc {exc.code().name}"
        finally:
            if math.isnan(sent.done_ms):
                sent.done_ms = self._clock.now_ms()
        return sent


def _set_headers(mutation: Any) -> dict[str, str]:
    return {h.header.key: (h.header.raw_value or h.header.value.encode()).decode() for h in mutation.set_headers}


@dataclass
class LoadRun:
    """Everything the clients sent, and how faithfully they kept their schedules."""

    sent: list[Sent]
    planned: int
    not_sent: int  # abandoned: the schedule fell more than LATE_LIMIT_S behind
    dropped: int  # a client already had MAX_IN_FLIGHT requests open
    max_lag_s: float  # the latest a request left after its scheduled time
    start_ms: float  # Redis's clock at the load's start
    end_ms: float  # start + the schedule's length


async def drive(targets: Sequence[str], key: str, schedules: Sequence[Sequence[Planned]], seconds: float,
                clock: RedisClock, pick_header: str, progress: Callable[[list[Sent], int], None]) -> LoadRun:
    """Every client's schedule, client ``i`` on ``targets[i % len(targets)]``, open loop: a request leaves at
    its time whether or not the client's earlier ones were answered. ``progress`` is called after each
    window of Redis's clock ends, with what was sent so far and the window that ended."""
    import grpc

    sent: list[Sent] = []
    tally = {"not_sent": 0, "dropped": 0, "lag": 0.0}
    start = time.monotonic() + 0.2  # every client starts from the same instant
    channels = [grpc.aio.insecure_channel(targets[i % len(targets)]) for i in range(len(schedules))]
    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 10)

        async def client(i: int) -> None:
            requests = Requests(channels[i], key, clock, pick_header)
            open_: set[asyncio.Task[Sent]] = set()
            for planned in schedules[i]:
                wait = start + planned.at_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                elif -wait > LATE_LIMIT_S:
                    tally["not_sent"] += 1
                    continue
                tally["lag"] = max(tally["lag"], -wait)
                if len(open_) >= MAX_IN_FLIGHT:
                    tally["dropped"] += 1
                    continue
                record = Sent(i, planned.tokens, clock.now_ms())
                sent.append(record)
                task = asyncio.create_task(requests.send(record, planned.body))
                open_.add(task)
                task.add_done_callback(open_.discard)
            if open_:
                await asyncio.gather(*open_)

        async def ticker() -> None:
            window = int(clock.at_ms(start) // WINDOW_MS)
            while True:  # one line a second after each window's end (late answers are in by then)
                await asyncio.sleep(max(0.0, clock.monotonic_at((window + 1) * WINDOW_MS + 1000) - time.monotonic()))
                progress(sent, window)
                window += 1

        ticking = asyncio.create_task(ticker())
        try:
            await asyncio.gather(*(client(i) for i in range(len(schedules))))
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking  # raises what killed it, if anything did
    finally:
        for channel in channels:
            await channel.close()
    return LoadRun(sent, sum(map(len, schedules)), tally["not_sent"], tally["dropped"], tally["lag"],
                   clock.at_ms(start), clock.at_ms(start + seconds))
