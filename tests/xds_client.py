"""The ADS test client: ``inferlb.bench.xds_bench.ads_client`` (the xDS benchmark's client fleet uses it too)."""

from inferlb.bench.xds_bench.ads_client import (  # noqa: F401 - re-exported for the tests
    CHANNEL_OPTIONS,
    RESOURCE_TYPES,
    DeltaClient,
    Decision,
    Received,
    SotwClient,
    decode,
    eds_names,
    resource_name,
)
