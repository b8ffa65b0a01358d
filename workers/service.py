"""The embedding service: tokenise, batch, infer, and report load.

Kept free of HTTP so it can be driven by the Starlette app or by tests alike;
``workers.app`` maps it onto routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import tokenizers

from .batcher import BatchCostModel, DeadlineExceeded, Embedded, MicroBatcher, Priority, QueueFull
from .config import WorkerConfig
from .metrics import WorkerMetrics
from .protocol import APIError, EmbeddingsRequest, embeddings_response, parse_embeddings_request
from .queue_order import Scheduling
from .request_options import RequestOptions

log = logging.getLogger("inferlb.worker")

# Serialising or tokenising more than this much goes to a thread, off the event loop.
INLINE_TEXT_CHARS = 8192
INLINE_RESPONSE_ROWS = 32
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer
WARMUP_TEXTS = ("inferlb warm-up", "load balancing " * 200)


class InputScheduler(Protocol):
    """Queues inputs for inference: ``MicroBatcher``, or ``workers.simulated.SlotScheduler`` when simulating."""

    cost: BatchCostModel

    @property
    def queued(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def embed(self, inputs: Sequence[Sequence[int]], *, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded: ...


class EmbeddingEngine(Protocol):
    """What the service needs from an inference engine (``workers.engine.Engine``)."""

    @property
    def dimensions(self) -> int: ...

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray: ...


@dataclass(frozen=True)
class ModelInfo:
    """The served model's identity and limits."""

    name: str
    max_tokens: int
    dimensions: int
    aliases: tuple[str, ...] = ()

    def accepts(self, requested: str | None) -> bool:
        return requested is None or requested == self.name or requested in self.aliases


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]


class EmbeddingService:
    def __init__(
        self,
        config: WorkerConfig,
        model: ModelInfo,
        tokenizer: tokenizers.Tokenizer,
        engine_factory: Callable[[], EmbeddingEngine],
        cpu_seconds: Callable[[], float] | None = None,
        scheduler_factory: Callable[[WorkerMetrics], InputScheduler] | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.metrics = WorkerMetrics(cpus=config.cpus, model=model.name, cpu_seconds=cpu_seconds)
        self._engine_factory = engine_factory
        self._engine: EmbeddingEngine | None = None
        # One inference thread: the engine's own intra-op threads do the parallel work.
        self._infer_executor = ThreadPoolExecutor(1, thread_name_prefix="inference")
        self.batcher: InputScheduler = scheduler_factory(self.metrics) if scheduler_factory else MicroBatcher(
            run_batch=self._run_batch,
            executor=self._infer_executor,
            observer=self.metrics,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_wait_s=config.max_batch_wait_ms / 1000.0,
            max_queue_items=config.max_queue_items,
            aging_s=config.aging_s,
            scheduling=Scheduling(config.scheduling),
        )
        # Names this worker in every answer, so a client behind any balancer can tell who served it.
        self.identity = f"{_advertised_host(config.host)}:{config.port}"
        self.ready = False
        self.draining = False
        self.not_ready_reason = "warming up"
        self.inflight = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.created = int(time.time())

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Start batching and warm up in the background; ``ready`` flips when warm-up passes."""
        self.batcher.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._warm_up(), name="warm-up"),
            loop.create_task(self._sample_load(), name="load-sampler"),
        ]

    def begin_drain(self) -> None:
        """Stop taking new work: readiness fails and new requests get 503."""
        if not self.draining:
            log.info("draining", extra={"inflight": self.inflight, "queued": self.batcher.queued})
        self.draining = True
        self.ready = False
        self.not_ready_reason = "shutting down"
        self.metrics.ready.set(0)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.inflight == 0

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.batcher.stop()
        self._infer_executor.shutdown(wait=True, cancel_futures=True)

    async def _warm_up(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            self._engine = await loop.run_in_executor(self._infer_executor, self._engine_factory)
            if self._engine.dimensions != self.model.dimensions:
                raise RuntimeError(f"engine gives {self._engine.dimensions} dimensions, expected {self.model.dimensions}")
            ids = [e.ids for e in self.tokenizer.encode_batch(list(WARMUP_TEXTS))]
            result = await self.batcher.embed(ids)
            norms = np.linalg.norm(result.vectors, axis=1)
            if not np.all(np.isfinite(result.vectors)) or not np.allclose(norms, 1.0, atol=1e-3):
                raise RuntimeError(f"warm-up embeddings are not unit vectors (norms {norms.tolist()})")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.not_ready_reason = f"warm-up failed: {exc}"
            log.error("warm-up failed", extra={"error": str(exc)})
            return
        if not self.draining:
            self.ready = True
            self.not_ready_reason = ""
            self.metrics.ready.set(1)
        log.info("ready", extra={"warmup_s": round(time.perf_counter() - started, 3), "model": self.model.name})

    async def _sample_load(self) -> None:
        while True:
            self.metrics.sample_load(self.batcher.cost.coefficients())
            await asyncio.sleep(0.5)

    def _run_batch(self, batch: list[Sequence[int]]) -> np.ndarray:
        assert self._engine is not None, "engine used before warm-up loaded it"
        return self._engine.embed(batch)

    # -- requests --------------------------------------------------------
    def load_header(self) -> dict[str, str]:
        return {
            "endpoint-load-metrics": self.metrics.orca_header(queued=self.batcher.queued, inflight=self.inflight)
        }

    async def embeddings(self, body: bytes, options: RequestOptions | None = None) -> Reply:
        """Serve one ``POST /v1/embeddings`` body; never raises for bad input.

        Cancelled (the client went away), it records a 499 and re-raises: its
        queued inputs have left the queue by then.
        """
        options = options or RequestOptions()
        started = time.perf_counter()
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        timing = ""
        try:
            if not self.ready:
                raise APIError(503, f"worker is not ready: {self.not_ready_reason}", type="server_error",
                               code="not_ready")
            request = parse_embeddings_request(body, max_inputs=self.config.max_inputs, vocab_size=self.vocab_size)
            if not self.model.accepts(request.model):
                raise APIError(404, f"The model '{request.model}' does not exist; this worker serves "
                               f"'{self.model.name}'", code="model_not_found", param="model")
            if request.dimensions is not None and request.dimensions != self.model.dimensions:
                raise APIError(400, f"'dimensions' must be {self.model.dimensions} for {self.model.name}, "
                               f"got {request.dimensions}", code="invalid_value", param="dimensions")
            inputs = await self._token_ids(request)
            tokens = sum(len(ids) for ids in inputs)
            limit = self.config.max_request_tokens
            if tokens > limit:
                raise APIError(400, f"the request has {tokens} tokens, over this worker's limit of {limit} per "
                               f"request; split its inputs into requests of at most {limit} tokens",
                               code="too_many_tokens", param="input")
            try:
                result = await self.batcher.embed(inputs, priority=options.priority, deadline=options.deadline)
            except QueueFull as exc:
                raise APIError(429, f"worker overloaded: {exc}", type="server_error", code="overloaded") from None
            except DeadlineExceeded as exc:
                raise APIError(504, f"deadline exceeded: {exc}", type="server_error",
                               code="deadline_exceeded") from None
            if len(inputs) > INLINE_RESPONSE_ROWS:
                payload = await asyncio.to_thread(self._serialise, request, result.vectors, tokens)
            else:
                payload = self._serialise(request, result.vectors, tokens)
            timing = f"queue;dur={result.queue_s * 1000:.3f}, compute;dur={result.compute_s * 1000:.3f}, "
            reply = Reply(200, payload, {"x-inferlb-tokens": str(tokens)})
        except APIError as exc:
            if exc.status >= 500:
                log.warning("request refused", extra={"status": exc.status, "error": exc.message})
            reply = Reply(exc.status, exc.body(), {})
        except asyncio.CancelledError:
            self.metrics.request_done(CLIENT_CLOSED, time.perf_counter() - started)
            raise
        except Exception as exc:  # a bug must cost one request, not the worker
            log.exception("request failed")
            err = APIError(500, f"internal error: {exc}", type="server_error", code="internal_error")
            reply = Reply(500, err.body(), {})
        finally:
            load = self.load_header()  # taken while this request still counts as in flight
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)
        elapsed = time.perf_counter() - started
        self.metrics.request_done(reply.status, elapsed)
        reply.headers["server-timing"] = f"{timing}total;dur={elapsed * 1000:.3f}"
        reply.headers["x-inferlb-worker"] = self.identity
        reply.headers.update(load)
        return reply

    def _serialise(self, request: EmbeddingsRequest, vectors: np.ndarray, tokens: int) -> bytes:
        return embeddings_response(
            vectors, model=self.model.name, prompt_tokens=tokens, encoding_format=request.encoding_format
        )

    async def _token_ids(self, request: EmbeddingsRequest) -> list[Sequence[int]]:
        limit = self.model.max_tokens
        if request.token_ids is not None:
            ids = list(request.token_ids)
            for i, arr in enumerate(ids):
                if len(arr) > limit:
                    if not request.truncate:
                        raise self._too_long(i, len(arr))
                    ids[i] = arr[:limit]
            return ids
        texts = list(request.texts or ())
        if sum(len(t) for t in texts) > INLINE_TEXT_CHARS:
            encodings = await asyncio.to_thread(self.tokenizer.encode_batch, texts)
        else:
            encodings = self.tokenizer.encode_batch(texts)
        if not request.truncate:
            for i, enc in enumerate(encodings):
                if enc.overflowing:
                    raise self._too_long(i, None)
        return [enc.ids for enc in encodings]

    def _too_long(self, index: int, length: int | None) -> APIError:
        size = f"has {length} tokens, more than" if length is not None else "is longer than"
        return APIError(
            400,
            f"input[{index}] {size} the model's limit of {self.model.max_tokens} tokens and 'truncate' is false",
            code="context_length_exceeded",
            param="input",
        )


def _advertised_host(host: str) -> str:
    """The listen address, or this machine's name when listening on every interface."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        import socket

        return socket.gethostname()
    return host
