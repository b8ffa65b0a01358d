"""The embedding service: resolve the model, tokenise, batch, infer, and report load.

Kept free of HTTP so it can be driven by the Starlette app or by tests alike;
``workers.app`` maps it onto routes. It serves one or more model versions
(``workers.model_catalog``) with one vocabulary: each version gets a copy of
the tokenizer truncating at its own ``max_tokens``.
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
from opentelemetry import trace

from inferlb_runtime.model_routing import MODEL_HEADER

from .batcher import BatchCostModel, DeadlineExceeded, Embedded, Priority, QueueFull
from .cached_embedding import CachedEmbedder
from .config import WorkerConfig
from .input_cache import InputCache
from .metrics import WorkerMetrics
from .model_batchers import ModelBatchers
from .model_catalog import ModelInfo, describe, resolve_model
from .protocol import APIError, EmbeddingsRequest, check_token_ids, embeddings_response, parse_request_shape
from .queue_order import Scheduling
from .request_options import RequestOptions
from .tokenization import truncated_at

log = logging.getLogger("inferlb.worker")

# Parsing, serialising or tokenising more than this much goes to a thread, off the event loop. A body of
# 64 KiB holds at most 32k token ids (each takes a digit and a separator) or 64k characters: parsed in
# about a millisecond. A larger one (up to max_body_bytes, 4 MiB: some 2M ids) takes tens of milliseconds
# and must not hold up probes and small requests.
INLINE_BODY_BYTES = 64 * 1024
INLINE_TEXT_CHARS = 8192
INLINE_RESPONSE_ROWS = 32
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer
WARMUP_TEXTS = ("inferlb warm-up", "load balancing " * 200)


class InputScheduler(Protocol):
    """Queues inputs for inference by a model version: ``ModelBatchers`` (a ``MicroBatcher`` per version), or
    ``workers.simulated.SlotScheduler`` when simulating."""

    cost: BatchCostModel
    slots: int  # how many jobs (batches or simulated requests) run at once: the worker's reported ``slots``

    @property
    def queued(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def embed(self, inputs: Sequence[Sequence[int]], *, model: str, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded: ...


class EmbeddingEngine(Protocol):
    """What the service needs from an inference engine (``workers.engine.Engine``)."""

    @property
    def dimensions(self) -> int: ...

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray: ...


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]


class EmbeddingService:
    def __init__(
        self,
        config: WorkerConfig,
        models: Sequence[ModelInfo],
        tokenizer: tokenizers.Tokenizer,
        engine_factory: Callable[[ModelInfo], EmbeddingEngine],
        cpu_seconds: Callable[[], float] | None = None,
        scheduler_factory: Callable[[WorkerMetrics], InputScheduler] | None = None,
    ) -> None:
        if not models:
            raise ValueError("a worker serves at least one model")
        self.config = config
        self.models = tuple(models)  # the first answers requests that name no model
        self.vocab_size = tokenizer.get_vocab_size()
        by_limit = {limit: truncated_at(tokenizer, limit) for limit in {model.max_tokens for model in self.models}}
        self._tokenizers = {model.name: by_limit[model.max_tokens] for model in self.models}
        self.metrics = WorkerMetrics(cpus=config.cpus, models=self.models, pool=config.pool, cpu_seconds=cpu_seconds)
        self._engine_factory = engine_factory
        self._engines: dict[str, EmbeddingEngine] = {}  # by version, filled at warm-up
        # One inference thread for every model: the engines' own intra-op threads do the parallel work.
        self._infer_executor = ThreadPoolExecutor(1, thread_name_prefix="inference")
        self.batcher: InputScheduler = scheduler_factory(self.metrics) if scheduler_factory else ModelBatchers(
            [model.name for model in self.models],
            self._run_batch,
            executor=self._infer_executor,
            observer=self.metrics,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_wait_s=config.max_batch_wait_ms / 1000.0,
            max_queue_items=config.max_queue_items,
            aging_s=config.aging_s,
            scheduling=Scheduling(config.scheduling),
        )
        self.metrics.slots.set(self.batcher.slots)
        # Requests go through the per-input cache; warm-up goes to the batcher directly (it must compute).
        # Simulated workers have no cache: their vectors are dummies and their cost is the point.
        cache = InputCache(0 if scheduler_factory else config.cache_max_bytes, observer=self.metrics)
        self.embedder = CachedEmbedder(self.batcher, cache, self.metrics)
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
        """Load every model and run one inference through each before turning ready: a worker that says it is
        ready must answer its first request of any version at full speed, and a broken build must not be
        routed to."""
        try:
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            for model in self.models:
                ids = [e.ids for e in self._tokenizers[model.name].encode_batch(list(WARMUP_TEXTS))]
                self.not_ready_reason = f"warming up {model.name}"
                engine = await loop.run_in_executor(self._infer_executor, self._engine_factory, model)
                if engine.dimensions != model.dimensions:
                    raise RuntimeError(f"{model.name}: engine gives {engine.dimensions} dimensions, "
                                       f"expected {model.dimensions}")
                self._engines[model.name] = engine
                result = await self.batcher.embed(ids, model=model.name)
                norms = np.linalg.norm(result.vectors, axis=1)
                if not np.all(np.isfinite(result.vectors)) or not np.allclose(norms, 1.0, atol=1e-3):
                    raise RuntimeError(f"{model.name}: warm-up embeddings are not unit vectors "
                                       f"(norms {norms.tolist()})")
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
        log.info("ready", extra={"warmup_s": round(time.perf_counter() - started, 3),
                                 "models": [model.name for model in self.models]})

    async def _sample_load(self) -> None:
        while True:
            self.metrics.sample_load(self.batcher.cost.coefficients())
            await asyncio.sleep(0.5)

    def _run_batch(self, model: str, batch: list[Sequence[int]]) -> np.ndarray:
        return self._engines[model].embed(batch)  # loaded at warm-up, before any request is taken

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
        model: ModelInfo | None = None
        try:
            if not self.ready:
                raise APIError(503, f"worker is not ready: {self.not_ready_reason}", type="server_error",
                               code="not_ready")
            request = await self._parse(body)
            model = self._model_for(request.model, options.model)
            if request.dimensions is not None and request.dimensions != model.dimensions:
                raise APIError(400, f"'dimensions' must be {model.dimensions} for {model.name}, "
                               f"got {request.dimensions}", code="invalid_value", param="dimensions")
            inputs = await self._token_ids(request, model)
            tokens = sum(len(ids) for ids in inputs)
            try:
                result = await self.embedder.embed(inputs, model=model.name, priority=options.priority,
                                                   deadline=options.deadline, policy=options.cache)
            except QueueFull as exc:
                raise APIError(429, f"worker overloaded: {exc}", type="server_error", code="overloaded") from None
            except DeadlineExceeded as exc:
                raise APIError(504, f"deadline exceeded: {exc}", type="server_error",
                               code="deadline_exceeded") from None
            if len(inputs) > INLINE_RESPONSE_ROWS:
                payload = await asyncio.to_thread(self._serialise, request, model, result.vectors, tokens)
            else:
                payload = self._serialise(request, model, result.vectors, tokens)
            timing = f"queue;dur={result.queue_s * 1000:.3f}, compute;dur={result.compute_s * 1000:.3f}, "
            span = trace.get_current_span()  # the request's span, when tracing (RequestContextMiddleware)
            if span.is_recording():
                _annotate(span, model, len(inputs), tokens, result)
            reply = Reply(200, payload, {"x-inferlb-tokens": str(tokens)})
        except APIError as exc:
            if exc.status >= 500:
                log.warning("request refused", extra={"status": exc.status, "error": exc.message})
            reply = Reply(exc.status, exc.body(), {})
        except asyncio.CancelledError:
            self.metrics.request_done(CLIENT_CLOSED, time.perf_counter() - started,
                                      model.name if model is not None else None)
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
        self.metrics.request_done(reply.status, elapsed, model.name if model is not None else None)
        reply.headers["server-timing"] = f"{timing}total;dur={elapsed * 1000:.3f}"
        reply.headers["x-inferlb-worker"] = self.identity
        if model is not None:
            reply.headers[MODEL_HEADER] = model.name
        reply.headers.update(load)
        return reply

    def _model_for(self, in_body: str | None, in_header: str | None) -> ModelInfo:
        """The version to run: the header's (ext_proc's choice) over the body's; 404 when not served here."""
        requested = in_header if in_header is not None else in_body
        model = resolve_model(self.models, requested)
        if model is None:
            where = f" (named in the {MODEL_HEADER} header)" if in_header is not None else ""
            raise APIError(404, f"The model '{requested}'{where} does not exist or is not served by this worker; "
                           f"it serves {describe(self.models)}", code="model_not_found",
                           param=MODEL_HEADER if in_header is not None else "model")
        return model

    @staticmethod
    def _serialise(request: EmbeddingsRequest, model: ModelInfo, vectors: np.ndarray, tokens: int) -> bytes:
        return embeddings_response(
            vectors, model=model.name, prompt_tokens=tokens, encoding_format=request.encoding_format
        )

    async def _parse(self, body: bytes) -> EmbeddingsRequest:
        """The body's fields and input shape (the number of inputs bounded first); in a thread when large."""
        if len(body) > INLINE_BODY_BYTES:
            return await asyncio.to_thread(parse_request_shape, body, max_inputs=self.config.max_inputs)
        return parse_request_shape(body, max_inputs=self.config.max_inputs)

    async def _token_ids(self, request: EmbeddingsRequest, model: ModelInfo) -> list[Sequence[int]]:
        """The inputs' token ids, truncated to the model's limit and within the request's token budget.

        Token arrays are bounded by their lengths alone (the model's limit, then
        ``max_request_tokens``) before a single id is read; only the ids kept
        are then checked, so a request costs per-token work of at most the
        budget however large its arrays. Texts are bounded once tokenised.
        """
        limit = model.max_tokens
        if request.token_ids is not None:
            arrays = request.token_ids
            if not request.truncate:
                for i, arr in enumerate(arrays):
                    if len(arr) > limit:
                        raise self._too_long(model, i, len(arr))
            self._check_budget(sum(min(len(arr), limit) for arr in arrays))
            ids = [arr[:limit] if len(arr) > limit else arr for arr in arrays]
            check_token_ids(ids, self.vocab_size, single_array=request.single_array)
            return ids
        texts = list(request.texts or ())
        tokenizer = self._tokenizers[model.name]
        if sum(len(t) for t in texts) > INLINE_TEXT_CHARS:
            encodings = await asyncio.to_thread(tokenizer.encode_batch, texts)
        else:
            encodings = tokenizer.encode_batch(texts)
        if not request.truncate:
            for i, enc in enumerate(encodings):
                if enc.overflowing:
                    raise self._too_long(model, i, None)
        self._check_budget(sum(len(enc.ids) for enc in encodings))
        return [enc.ids for enc in encodings]

    def _check_budget(self, tokens: int) -> None:
        """400 ``too_many_tokens`` for a request over ``max_request_tokens``, saying how to split it."""
        limit = self.config.max_request_tokens
        if tokens > limit:
            raise APIError(400, f"the request has {tokens} tokens, over this worker's limit of {limit} per "
                           f"request; split its inputs into requests of at most {limit} tokens",
                           code="too_many_tokens", param="input")

    @staticmethod
    def _too_long(model: ModelInfo, index: int, length: int | None) -> APIError:
        size = f"has {length} tokens, more than" if length is not None else "is longer than"
        return APIError(
            400,
            f"input[{index}] {size} the model's limit of {model.max_tokens} tokens and 'truncate' is false",
            code="context_length_exceeded",
            param="input",
        )


def _annotate(span: trace.Span, model: ModelInfo, inputs: int, tokens: int, result: Embedded) -> None:
    """What the request's trace span tells about its inference: the version, its size, the time it queued
    and computed (the figures ``server-timing`` reports), and the batches its inputs ran in."""
    span.set_attributes({
        "inferlb.model.version": model.name,
        "inferlb.inputs": inputs,
        "inferlb.tokens": tokens,
        "inferlb.queue_ms": round(result.queue_s * 1000, 3),
        "inferlb.compute_ms": round(result.compute_s * 1000, 3),
        "inferlb.batch.ids": [batch for batch, _ in result.batches],
        "inferlb.batch.sizes": [size for _, size in result.batches],
    })


def _advertised_host(host: str) -> str:
    """The listen address, or this machine's name when listening on every interface."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        import socket

        return socket.gethostname()
    return host
