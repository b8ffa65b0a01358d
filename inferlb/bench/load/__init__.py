"""What a bench sends and how: the scenario (TOML), the trace precomputed from it, the request texts and
classes, the open-loop load generator, wrk for closed-loop ceilings, and Envoy's own log of when each
request was answered. The simulator replays the same scenario and trace, so both live here, below it."""
