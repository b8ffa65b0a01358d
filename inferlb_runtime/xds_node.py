"""What an xDS client tells the control plane about itself in its ``Node`` metadata.

ext_proc names its ``/metrics`` port there; the control plane reads the
replica's decision count at that port, on the IP its stream comes from, to
partition a large fleet among the replicas that carry traffic
(docs/design.md, "Partitions").
"""

from __future__ import annotations

METRICS_PORT_KEY = "inferlb.metrics_port"
