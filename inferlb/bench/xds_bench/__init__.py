"""``inferlb bench xds``: how long a weight change takes to reach every
connected xDS client, and what it costs the control plane.

For each configuration (mode x endpoints x clients) a fresh control-plane
process runs the production path in-process: ``SnapshotCache`` +
``serve_xds`` on a free 127.0.0.1 port, and the real ``Controller`` (its
``publish``: ``build_snapshot`` in ``asyncio.to_thread``, then
``set_default_snapshot`` on the loop; once the Envoys ACK it, ext_proc's
snapshot with the rich EDS, which no client here subscribes to; the
debouncer is not started, so the debounce delay, 0.1 s by default in
production, is not in the figures). Every client is in the Envoys' node
group: they get the lean EDS (address, health, weight).
Clients connect like Envoy (CDS and LDS wildcard, EDS for the workers
cluster, RDS by name) and ACK every response:

  * N-1 lightweight ADS clients (``ads_client.py``), all in ONE separate
    client-fleet process, one gRPC connection each;
  * 1 real Envoy 1.40 (the project's bootstrap, a free admin port; the
    listener port in DataPlaneSettings is free too). ``--no-envoy``: N
    lightweight clients instead.

Measurement (server side, one clock, no cross-process timing): a weight
change is applied to the controller's state off the clock, then the clock
starts and ``Controller.publish()`` runs. The server's XdsMetrics hook
``on_ack`` (called synchronously when a stream records an ACK) checks
``cache.clients()`` once at least N EDS ACKs arrived; the round converges
the moment every client's acked EDS version equals the new snapshot's EDS
version. Reported per round:

  conv     weight change -> last ACK processed (build + push + ACKs)
  push     set_default_snapshot -> last ACK
  build    publish() start -> set_default_snapshot (the Envoys' snapshot,
           in the worker thread)
  EDS B    bytes of one EDS response as a lightweight client received it
           (the protobuf message; gRPC/HTTP2 framing excluded); x N = total
  CPU      control-plane process CPU seconds (all threads; process_time,
           ns resolution) from the change to convergence, and that as % of
           the wall time (100% = one core)
  RSS      control-plane process RSS after the round (max over rounds)

"change=all" changes every endpoint's weight (a policy recompute);
"change=one" changes a single endpoint's weight (Delta, --single-clients
clients). The ClusterLoadAssignment is ONE resource that holds every
endpoint, so Delta resends the whole CLA in both cases: compare the bytes.

Endpoints carry scraped telemetry by default (as in production; it rides in
ext_proc's EDS metadata only, which the Envoys' snapshot does not carry;
--no-telemetry drops it). Per round, the JSON also has ``publish_ms``: until
publish() returned (the wait for the Envoys' ACKs and ext_proc's snapshot
included). Endpoint addresses are
127.77.x.y:1 (loopback, nothing listens): the Envoy's health checks fail
fast and touch nobody; their interval is --envoy-health-check-interval
(default 60 s, so that Envoy does not health-check 10,000 hosts a second
on the same cores as the control plane).

Targets: 10,000 endpoints x 50 clients converge in <= 1 s; a single-weight
change with Delta at 10 clients in <= 50 ms.

Usage:
  inferlb bench xds                      # the full matrix (minutes)
  inferlb bench xds --quick              # about a minute (see --quick)
  inferlb bench xds --endpoints 100 --clients 2 --rounds 2 --modes delta --single-clients 2
  inferlb bench xds --json bench_xds.json --no-envoy

Modules: ``command`` (options, the matrix, one process per configuration),
``configuration`` (that process: the control plane's path and the rounds),
``spec``, ``hooks`` (the cache and metrics hooks that stamp convergence),
``children`` (the client fleet and the Envoy), ``fleet`` (the client-fleet
process), ``ads_client``, ``report``.
"""
