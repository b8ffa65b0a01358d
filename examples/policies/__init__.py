"""Example routing policies, loadable by ``module:attribute``:

* ``examples.policies.sticky_session:SessionAffinity`` (a scorer of ext_proc's pick chain):
  the same ``x-session-id`` to the same worker, with bounded load.
* ``examples.policies.canary:CanaryWeightPolicy`` (a weight policy, control plane):
  one canary worker at a fixed share of the traffic.

Each is a small, documented module with its tests in ``tests/test_example_policies.py``.
"""
