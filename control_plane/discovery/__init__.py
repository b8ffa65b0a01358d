"""Endpoint discovery: providers that find workers (DNS, Kubernetes EndpointSlices) and
the reconciliation that turns what they found into the controller's endpoints.

Each provider owns the endpoints of one ``source``: it reports the whole set it
sees (a snapshot), never deltas, so a missed update heals itself on the next
one. A provider that fails reports the failure and no snapshot: the fleet keeps
the last known set (an API outage must never empty it).
"""
