"""Usage for billing: what each tenant sent through ext_proc, per minute, kept in the control plane's store.

How it flows:

1. Every ext_proc replica counts each finished request by tenant and outcome
   (``inferlb_ext_proc_tenant_requests_total`` and ``_tokens_total``).
2. The control plane already reads every connected replica's ``/metrics``
   each scrape interval (``replica_activity``, at the IP its xDS stream comes
   from); the same body, parsed once, gives the usage counters
   (``readings``: bounded, untrusted input) and the replica's
   ``process_start_time_seconds``.
3. ``ingest`` writes, for each (instance, tenant) whose counters moved, the
   cumulative values seen into that minute's row of the store
   (``store.usage``). An instance is the node id and the process start, so a
   restarted replica is a new instance whose counters start from zero.
4. ``GET /v1/usage`` (``query``) asks the store for the differences between
   consecutive rows, summed per tenant and bucket.

**Why cumulative rows rather than increments, and no single writer.** Every
control-plane replica sharing one PostgreSQL scrapes every ext_proc it
serves, so two of them may see the same counters. Adding increments would
count that usage twice; electing one writer needs a lease and leaves a gap
when it dies. Storing what was seen (the cumulative values, the larger one
kept on conflict) makes every write idempotent: any number of replicas, a
retried write, or a control plane restarted in the middle of a minute leave
the same rows, and the differences taken when reading count each request
once. The cost is a difference taken at read time (SQL window functions in
both stores).
"""
