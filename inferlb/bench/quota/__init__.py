"""Tenants' quotas: ``inferlb bench quota`` (what the key lookup and quota check cost ext_proc per
request) and ``quota-accuracy`` (tokens admitted per window against the quota, two ext_proc replicas on
one Redis)."""
