"""Example request stages of ext_proc, added by configuration (``[[ext_proc.stages]]``):

* ``examples.stages.max_inputs:MaxInputs``: refuse a request with more inputs than the operator allows,
  before the cache, the fair queue and the pick see it.

Each is a small, documented module with its tests in ``tests/test_example_stages.py``.
"""
