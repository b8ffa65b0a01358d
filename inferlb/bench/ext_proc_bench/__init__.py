"""``inferlb bench ext-proc``: what the ext_proc filter adds to a request, and how many
decisions one ext_proc process makes per second (issue 4, "Benchmark").

One stack on loopback, free ports: N simulated workers (`python -m workers
--simulate`, a tiny cost so they do not dominate), the control plane, ext_proc,
and two Envoys with one worker thread each (`--concurrency 1`):

  * "ext_proc": the real stack's Envoy, configured over ADS by the control
    plane (listener with the ext_proc filter, override_host on the pick);
  * "baseline": the same Envoy without the filter: the bench's one static
    Envoy config (inferlb.bench.stack.dataplanes.envoy_static, built from
    control_plane.resources: the same listener, route and workers cluster)
    with the ext_proc filter removed from the HTTP filter chain. Not
    "ext_proc stopped": with failure_mode_allow Envoy would still open a
    gRPC stream per request to the dead service.

Phases:

 1. Overhead. The bench's open-loop load generator (inferlb.bench.load.loadgen:
    aiohttp on uvloop, keep-alive connections) sends real OpenAI embeddings
    bodies (short texts) on a precomputed schedule (Poisson arrivals by
    default) at each rate, to each configuration, interleaved in rounds.
    Latency is measured from the *scheduled* send time, so a late send or a
    request waiting for a free connection counts against the system (no
    coordinated omission). The generator reports how late it sent (lag) and
    its CPU, so you can see whether it kept up. Added latency = ext_proc -
    baseline, per percentile. A third configuration, the filter floor, is a
    static Envoy with the ext_proc filter whose ext_proc is a trivial
    servicer on ext_proc's gRPC front (constant answers, no pick): what the
    filter's three round trips add when the servicer does no work.
 2. Saturation through Envoy, wrk (closed loop, 64 connections; ext_proc's
    decisions/s from its counter inferlb_ext_proc_decisions_total, CPU of
    every process from psutil):
    a. through the stack's two Envoys to the simulated workers;
    b. through static Envoys to a fake worker (an Envoy that answers, once
       the body is in, with a worker's real answer and headers), so the
       upstream costs nothing: no filter; a trivial grpcio aio
       ExternalProcessor (constant answers: the framework's floor) with 3, 2
       (response headers SKIP) and 1 (body only) messages per request; the
       real ext_proc with 3 and 2 messages. Body only is a floor, not an
       option: with request headers SKIP Envoy's router picks the host on
       the headers, before ext_proc answers, so the pick is ignored.
 3. ext_proc alone: a gRPC client that plays Envoy's three messages per
    request (request headers, the buffered body, the response headers a
    simulated worker really answered for that body), ext_proc pinned to one
    core and the client to the other: decisions/s and decisions per ext_proc
    CPU-second ("on one core"); the same for the trivial servicer, the floor
    to compare against in the same run, and, when the stack's ext_proc runs
    on its native gRPC front, for a second ext_proc on grpcio's aio server
    (`--grpc-front grpcio`, same control plane: the front it replaced) and
    for the trivial servicer on the native front.
 4. Profile (by default only when a target is missed): `perf record` of
    ext_proc under that load (CPU by shared object: interpreter, grpc core,
    kernel, tokenizers...), then ext_proc under cProfile (`python -m
    cProfile -m ext_proc`): where its main thread's time goes.

Targets (issue 4): added p50 <= 1 ms at 500 req/s; >= 4,000 decisions/s on one
core with real token counting.

Prints progress lines and a table; --json FILE writes every figure.
Default run: about 5 minutes on a 2-core machine; --quick: about 1.5 minutes.
(BENCH_ENVOY_LOG=debug with --keep-logs: the static Envoys log at debug level.)

Modules: ``command`` (options, the run), ``stack`` (the processes), ``workload``,
``cpu`` (CPU accounting and pinning), ``overhead``, ``saturation``, ``grpc_load``,
``trivial`` (the floor servicer), ``profile``, ``report``.
"""
