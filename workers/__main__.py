"""``python -m workers``: serve embeddings, or ``python -m workers prepare`` the model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from inferlb_runtime.tracing import TracingConfig, start_tracing

from .config import WorkerConfig, load_config
from .model_catalog import KNOWN_VERSIONS, ModelInfo
from .queue_order import SCHEDULINGS, QueueOrder, Scheduling
from .simulated import (
    DEFAULT_FIXED_S,
    DEFAULT_PER_TOKEN_S,
    Simulation,
    SimulatedEngine,
    SlotScheduler,
    parse_model_costs,
    parse_speed_schedule,
)

log = logging.getLogger("inferlb.worker")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers",
        description=(
            "Serve all-MiniLM-L6-v2 embeddings over an OpenAI-compatible API with micro-batching, "
            "Prometheus metrics and ORCA load reports. Settings come from --config FILE ([worker] table), "
            "then INFERLB_WORKER_<NAME> environment variables, then these flags.\n\n"
            "Run 'python -m workers prepare' first (or 'make model') to build the ONNX models.\n\n"
            "Tracing: off unless the standard OTEL_* variables turn it on (e.g. OTEL_EXPORTER_OTLP_ENDPOINT="
            "http://collector:4317); every log line of a request carries its x-request-id (docs/tracing.md)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="TOML file with a [worker] table")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8101)")
    p.add_argument("--data-dir", type=Path, help="model cache and state (default $INFERLB_DATA_DIR or ./.inferlb)")
    p.add_argument("--precision", choices=["int8", "fp32"],
                   help="the precision of the model version served when --models is not given (default int8)")
    p.add_argument("--models", metavar="VERSION,...",
                   help="model versions to serve, comma-separated, the first answering requests that name no model "
                        f"(known: {', '.join(KNOWN_VERSIONS)}; default: the version of --precision). A request's "
                        "x-inferlb-model header, else its body's model (a version or an alias such as "
                        "all-MiniLM-L6-v2: the first version with it), picks the version")
    p.add_argument("--pool", help="the pool this worker belongs to, a Kubernetes name (default 'default')")
    p.add_argument("--threads", dest="intra_op_threads", type=int, help="ONNX Runtime intra-op threads (default 1)")
    p.add_argument("--spinning", dest="allow_spinning", action="store_true", default=None,
                   help="let ONNX Runtime threads spin (off by default: workers share cores)")
    p.add_argument("--cpus", type=float, help="cores allotted; cpu_utilization is a fraction of this (default 1)")
    p.add_argument("--max-batch-tokens", type=int, help="padded tokens per batch (default 256)")
    p.add_argument("--max-batch-size", type=int, help="inputs per batch (default 64)")
    p.add_argument("--max-batch-wait-ms", type=float, help="cap of the adaptive batch window (default 5)")
    p.add_argument("--scheduling", choices=SCHEDULINGS,
                   help="order of waiting requests within a class: las (least attained service: the least-served "
                        "request gets the next batch), round_robin (one batch each in turn) or fifo (arrival "
                        "order, whole requests); default las")
    p.add_argument("--aging", dest="aging_s", type=float,
                   help="seconds a waiting request takes to climb one priority class (default 2)")
    p.add_argument("--max-inputs", type=int, help="inputs per request (default 2048)")
    p.add_argument("--max-request-tokens", type=int,
                   help="tokens per request, all inputs together (default 16384, about 2 s on one core)")
    p.add_argument("--cache-max-bytes", type=int,
                   help="bytes of the per-input cache of embeddings, keyed by model version and token ids, least "
                        "recently used evicted; identical inputs in flight are also computed once. 0 turns both "
                        "off (default 32 MiB). A request's Cache-Control: no-cache skips the lookup, no-store also "
                        "the store. --simulate workers have no cache")
    p.add_argument("--max-body-bytes", type=int, help="request body limit (default 4 MiB)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float,
                   help="seconds in-flight requests get after SIGTERM (default 30)")
    p.add_argument("--access-log", action="store_true", default=None, help="log every request")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    _add_simulation_arguments(p)
    return p


def _add_simulation_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--simulate`` group: the emulated fleet's costs, slots and faults."""
    sim = p.add_argument_group(
        "simulation",
        "--simulate replaces the model with dummy unit vectors and a timed wait: requests queue in class order "
        "(then arrival) for --sim-slots slots, one request per slot, each taking (fixed + per_token * its tokens) * cost_scale / speed "
        "seconds (speed read when it starts). Everything else (API, tokenisation, metrics, ORCA) is real. "
        "For emulating a heterogeneous fleet on one machine. GET/PUT /v1/simulation reads/sets the speed.",
    )
    sim.add_argument("--simulate", action="store_true", help="serve simulated inference (dummy vectors)")
    sim.add_argument("--speed", type=float, default=1.0, help="relative speed of the simulated machine (default 1)")
    sim.add_argument("--speed-schedule", default="", metavar="T:SPEED,...",
                     help="change the speed T seconds after start, e.g. 30:0.25 for a 4x slowdown at 30 s")
    sim.add_argument("--sim-fixed-ms", type=float, default=DEFAULT_FIXED_S * 1000,
                     help=f"simulated fixed cost per request (default {DEFAULT_FIXED_S * 1000:g} ms)")
    sim.add_argument("--sim-per-token-us", type=float, default=DEFAULT_PER_TOKEN_S * 1e6,
                     help=f"simulated cost per token (default {DEFAULT_PER_TOKEN_S * 1e6:g} us)")
    sim.add_argument("--sim-cost-scale", type=float, default=1.0, metavar="X",
                     help="multiply both simulated costs, e.g. to make the emulated fleet, not the host, the "
                          "bottleneck (default 1)")
    sim.add_argument("--sim-slots", type=int, default=1, metavar="K",
                     help="requests served at once; the rest wait in class order (default 1)")
    sim.add_argument("--model-cost", action="append", default=[], metavar="VERSION=X",
                     help="multiply the simulated cost of one served version, e.g. all-MiniLM-L6-v2-fp32=2.0 "
                          "(repeat or comma-separate; default 1 each); the versions share the slots")
    sim.add_argument("--sim-fail-rate", type=float, default=0.0, metavar="P",
                     help="a simulated fault: answer this share of embeddings requests 500 at once, before any "
                          "queue (a broken worker that looks fast); PUT /v1/simulation {\"fail_rate\": P} changes "
                          "it at run time (default 0)")


def _prepare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers prepare",
        description="Convert the packaged all-MiniLM-L6-v2 weights to ONNX (fp32 and int8), cached in the data dir.",
    )
    p.add_argument("--data-dir", type=Path, help="default $INFERLB_DATA_DIR or ./.inferlb")
    return p


def prepare(argv: Sequence[str]) -> int:
    from .model_store import prepare_models

    args = _prepare_parser().parse_args(argv)
    config = load_config(overrides={"data_dir": args.data_dir})
    artifacts = prepare_models(config.data_dir, progress=lambda msg: print(f"[model] {msg}", flush=True))
    print(f"[model] fp32: {artifacts.fp32}\n[model] int8: {artifacts.int8}", flush=True)
    return 0


def served_models(config: WorkerConfig) -> list[ModelInfo]:
    """The catalogue entries of the versions ``config`` serves, in its order."""
    return [KNOWN_VERSIONS[name].info for name in config.served_models]


def build_service(config: WorkerConfig):  # type: ignore[no-untyped-def]
    """Load the tokenizer now and each version's engine at warm-up, from the prepared models or packaged files."""
    import dataclasses

    from .engine import Engine
    from .model_store import prepare_models
    from .service import EmbeddingService
    from .tokenization import load_tokenizer

    # Built even when only packaged versions are served: the tokenizer every version uses comes with it.
    artifacts = prepare_models(config.data_dir, progress=lambda msg: log.info(msg))
    models = [dataclasses.replace(model, max_tokens=artifacts.max_tokens, dimensions=artifacts.dimensions)
              if KNOWN_VERSIONS[model.name].precision else model for model in served_models(config)]
    # Located now: a missing package fails the start, not a warm-up that never ends.
    graphs = {model.name: KNOWN_VERSIONS[model.name].graph({"int8": artifacts.int8, "fp32": artifacts.fp32})
              for model in models}

    def engine_factory(model: ModelInfo) -> Engine:
        known = KNOWN_VERSIONS[model.name]
        return Engine(graphs[model.name], output=known.output, normalise=known.normalise,
                      intra_op_threads=config.intra_op_threads, allow_spinning=config.allow_spinning)

    return EmbeddingService(config, models, load_tokenizer(artifacts.tokenizer, artifacts.max_tokens), engine_factory)


def build_simulated_service(config: WorkerConfig, simulation: Simulation, slots: int = 1,  # type: ignore[no-untyped-def]
                            model_costs: dict[str, float] | None = None):
    """The real service around a simulated engine; needs only the packaged tokenizer, not the ONNX build."""
    from .model_files import find_packaged_model
    from .service import EmbeddingService
    from .tokenization import load_tokenizer

    models = served_models(config)
    tokenizer = load_tokenizer(find_packaged_model().tokenizer, models[0].max_tokens)

    def scheduler(metrics):  # type: ignore[no-untyped-def]
        return SlotScheduler(simulation, slots=slots, observer=metrics, max_queue_items=config.max_queue_items,
                             dimensions=models[0].dimensions,
                             order=QueueOrder(Scheduling(config.scheduling), config.aging_s), model_costs=model_costs)

    # Utilisation is busy slot time over the K slots: 1.0 means every slot is always busy.
    return EmbeddingService(config, models, tokenizer, lambda model: SimulatedEngine(simulation, model.dimensions),
                            cpu_seconds=lambda: simulation.busy_seconds() / slots, scheduler_factory=scheduler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare":
        return prepare(argv[1:])
    args = _serve_parser().parse_args(argv)
    sim_flags = ("simulate", "speed", "speed_schedule", "sim_fixed_ms", "sim_per_token_us", "sim_cost_scale",
                 "sim_slots", "model_cost", "sim_fail_rate")
    overrides = {k: v for k, v in vars(args).items() if k != "config" and k not in sim_flags}
    try:
        config = load_config(args.config, overrides)
        if args.sim_slots < 1:
            raise ValueError(f"--sim-slots must be >= 1, got {args.sim_slots}")
        if not args.sim_cost_scale > 0:
            raise ValueError(f"--sim-cost-scale must be > 0, got {args.sim_cost_scale}")
        scale = args.sim_cost_scale
        simulation = Simulation(
            speed=args.speed, fixed_s=args.sim_fixed_ms / 1000 * scale, per_token_s=args.sim_per_token_us / 1e6 * scale,
            schedule=parse_speed_schedule(args.speed_schedule), fail_rate=args.sim_fail_rate,
        ) if args.simulate else None
        if args.sim_fail_rate and not args.simulate:
            raise ValueError("--sim-fail-rate needs --simulate: it is a simulated fault")
        if args.model_cost and not args.simulate:
            raise ValueError("--model-cost needs --simulate: a real model costs what it costs")
        model_costs = parse_model_costs(args.model_cost, config.served_models)
        tracing_config = TracingConfig.from_env(os.environ, "inferlb-worker")  # OTEL_*: off unless set
    except (ValueError, OSError) as exc:
        print(f"python -m workers: {exc}", file=sys.stderr)
        return 2
    from .server import configure_logging, serve

    configure_logging(config.log_level, component=f"worker:{config.port}")
    log.info("starting", extra={"host": config.host, "port": config.port, "models": list(config.served_models),
                                "pool": config.pool, "threads": config.intra_op_threads, "simulate": args.simulate})
    tracing = start_tracing(tracing_config)
    if simulation is not None:
        from .app import simulation_routes

        serve(config, build_simulated_service(config, simulation, args.sim_slots, model_costs),
              simulation_routes(simulation), tracing, simulated_failure=simulation.fails_now)
    else:
        serve(config, build_service(config), tracing=tracing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
