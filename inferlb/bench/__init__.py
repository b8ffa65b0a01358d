"""``inferlb bench``: the benchmark harness, grouped by what each bench measures.

The shared parts, which every bench below and the simulator (``inferlb.sim``) build on:

- ``load/``: what is sent and how: the scenario file, its precomputed trace, the request texts and
  classes, the open-loop generator (``loadgen``), wrk for closed-loop ceilings, Envoy's answer log;
- ``report/``: the figures: ``RunResult``, latency histograms, the comparison table, rounds, plots,
  metric expositions;
- ``stack/``: the system under test: the worker fleet (simulated or real ONNX, with CPU quotas), the
  data planes (Envoy, NGINX), the readiness port;
- ``processes.py``: one group of child processes, started and stopped together (the tests use it too).

The benches, each importing only the shared parts and the benches below it:

- ``routing/``: ``inferlb bench run``, a scenario against every data-plane configuration; capacity,
  rounds of a real fleet. The other live benches reuse its ``ScenarioRunner``;
- ``worker/``, ``xds_bench/``, ``ext_proc_bench/``: one component each, on its own;
- ``quota/``: a tenant's key lookup and quota check, and the quota's accuracy;
- ``fairness/``: who is served when the fleet is saturated: tenants' fair shares, classes under
  overload, short requests among hogs;
- ``cache/``: the response cache off and on;
- ``reliability/``: faults under load and the long soak;
- ``deploy/``: the fleet changing under load: canary and rollback (``rollout``), scaling (``autoscale``).

``cli.py`` parses the arguments of all of them.
"""
