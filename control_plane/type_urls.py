"""xDS type URLs and the order in which a change is pushed (make before break)."""

from inferlb_runtime.api_keys import KEYS_TYPE_URL

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
KEYS = KEYS_TYPE_URL  # the API key table (inferlb_runtime.api_keys): ext_proc's node group only

# What Envoy gets, CDS -> EDS -> LDS -> RDS; removals go out after all of these.
PUSH_ORDER: tuple[str, ...] = (CLUSTER, ENDPOINT, LISTENER, ROUTE)
# Every type the server serves, in push order: Envoy's, then the types only ext_proc subscribes to. A
# snapshot carries those only when its builder gives them (the Envoys' never does: Envoy has no such type).
SERVED_TYPES: tuple[str, ...] = (*PUSH_ORDER, KEYS)
EXTENSION_TYPES = frozenset(SERVED_TYPES) - frozenset(PUSH_ORDER)
SHORT_NAMES = {CLUSTER: "cds", ENDPOINT: "eds", LISTENER: "lds", ROUTE: "rds", KEYS: "keys"}
