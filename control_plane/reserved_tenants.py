"""Tenant names the API-key side may not use: the names ext_proc's metrics give traffic that has no tenant.

ext_proc counts a request without a key under ``anonymous``
(``inferlb_runtime.api_keys.ANONYMOUS_TENANT``) and the tenants beyond its
label cap under ``other`` (``ext_proc/metrics.py``). Usage for billing is
read from those counters by tenant label, so a key issued for either name
would be billed for everybody's unkeyed or overflow traffic. Creating one is
refused (422 ``tenant_reserved``); a key stored before this rule is kept and
flagged (a warning at start, ``reserved_tenant`` in ``GET /v1/api-keys``),
never deleted behind the operator's back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from inferlb_runtime.api_keys import ANONYMOUS_TENANT

from .store import StoredApiKey

# ext_proc's label for tenants beyond its cap (a literal in ext_proc/metrics.py; tests/test_reserved_tenants.py
# checks that the two agree).
OVERFLOW_TENANT = "other"
RESERVED_TENANTS = frozenset({ANONYMOUS_TENANT, OVERFLOW_TENANT})
WHY = {ANONYMOUS_TENANT: "ext_proc counts requests without an API key under it",
       OVERFLOW_TENANT: "ext_proc counts the tenants beyond its label cap under it"}


def is_reserved(tenant: str) -> bool:
    return tenant in RESERVED_TENANTS


def reserved_message(tenant: str) -> str:
    """Why ``tenant`` cannot have keys, for the 422 and the start-up warning."""
    return (f"the tenant name {tenant!r} is reserved: {WHY[tenant]}, so its usage would mix with that traffic's "
            f"and be billed to the key's tenant; choose another name (reserved: "
            f"{', '.join(sorted(RESERVED_TENANTS))})")


def warn_reserved(keys: Iterable[StoredApiKey], log: logging.Logger) -> list[str]:
    """Log one WARNING naming the stored keys whose tenant is reserved (kept, not deleted); their ids."""
    flagged = sorted((k for k in keys if is_reserved(k.tenant)), key=lambda k: k.id)
    if flagged:
        log.warning("API keys with a reserved tenant name are stored: their usage mixes with unkeyed or overflow "
                    "traffic; revoke them and issue keys under another tenant",
                    extra={"key_ids": [k.id for k in flagged], "tenants": sorted({k.tenant for k in flagged}),
                           "live": [k.id for k in flagged if k.live]})
    return [k.id for k in flagged]
