"""xDS type URLs and the order in which a change is pushed (make before break)."""

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"

# CDS -> EDS -> LDS -> RDS; removals go out after all of these.
PUSH_ORDER: tuple[str, ...] = (CLUSTER, ENDPOINT, LISTENER, ROUTE)
SHORT_NAMES = {CLUSTER: "cds", ENDPOINT: "eds", LISTENER: "lds", ROUTE: "rds"}
