"""``inferlb bench cache``: issue 16's response cache, off and on, on the same trace: throughput at the
SLO and a hit's latency."""
