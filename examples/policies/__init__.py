"""Example routing policies, loadable by ``module:attribute``:

* ``examples.policies.sticky_session:SessionAffinity`` (a scorer of ext_proc's pick chain):
  the same ``x-session-id`` to the same worker, with bounded load.
* ``examples.policies.canary:CanaryFilter`` (a filter of ext_proc's pick chain): one canary worker
  gets an exact share of the picks.
* ``examples.policies.canary_weights:CanaryWeightPolicy`` (a weight policy, control plane): the same
  canary as EDS weights (what Envoy's fallback and weighted sampling go by).

Each is a small, documented module with its tests in ``tests/test_example_policies.py``.
"""
