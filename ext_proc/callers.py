"""Who is calling: a request's API key turned into its tenant, class, weight and quota, or a 401.

ext_proc is the gateway's one place that sees every request before it runs,
so it is where keys are checked (the workers never see one: the
``authorization`` header is removed before the request is forwarded). The
key table comes from the control plane over xDS (``XdsClient.key_table``);
this module only decides, on the table it is given.

Rules, in order:

* a known key: its tenant, weight and quota; its class is the default and
  also the best the request may claim (a header may ask for a lower class,
  e.g. a batch job marking itself ``sheddable``, never a higher one);
* with keys required: no key or an unknown (or revoked) one is 401
  ``invalid_api_key``, and no table yet (the control plane not reached since
  start) is 503 ``api_keys_unavailable``: a key cannot be judged, so nothing
  passes, and nothing valid is refused as invalid;
* keys not required: anything else is the anonymous tenant, no quota, and
  the class header as the client sends it. An unknown key is not refused
  then: the OpenAI SDKs always send some key, and the quickstart has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferlb_runtime.api_keys import ANONYMOUS_TENANT, Quota, bearer_key
from inferlb_runtime.request_class import Priority

from .model import Reply
from .xds.tenants import KeyTable

AUTHORIZATION_HEADER = "authorization"


@dataclass(frozen=True, slots=True)
class Caller:
    """What a request's key says about how to treat it."""

    tenant: str
    key_id: str | None  # None: anonymous
    priority: Priority  # the class when the request names none
    best: Priority  # the best class it may claim
    weight: float
    quota: Quota

    def priority_for(self, asked: Priority | None) -> Priority:
        """The class a request asking for ``asked`` (None: no header) gets."""
        if asked is None:
            return self.priority
        return max(asked, self.best)  # a lower rank is a better class


ANONYMOUS = Caller(ANONYMOUS_TENANT, None, Priority.STANDARD, Priority.CRITICAL, 1.0, Quota())

MISSING_KEY = Reply(
    401, "invalid_api_key",
    "You didn't provide an API key. Send it in the Authorization header as a bearer token "
    "(Authorization: Bearer YOUR_KEY); the operator issues keys with POST /v1/api-keys.",
    type="invalid_request_error")
INVALID_KEY = Reply(
    401, "invalid_api_key", "Incorrect API key provided: it is unknown or revoked. Ask the operator for a key.",
    type="invalid_request_error")
NO_TABLE = Reply(
    503, "api_keys_unavailable",
    "API keys cannot be checked yet: this gateway has not received the key table from its control plane. "
    "Retry shortly.", retry_after_s=1)


def identify(authorization: str | None, table: KeyTable | None, require: bool) -> Caller | Reply:
    """The caller an ``Authorization`` header value names, or the reply refusing the request."""
    key = bearer_key(authorization)
    entry = table.lookup(key) if key is not None and table is not None else None
    if entry is not None:
        return Caller(entry.tenant, entry.id, entry.priority, entry.priority, entry.weight, entry.quota)
    if not require:
        return ANONYMOUS
    if table is None:
        return NO_TABLE
    return MISSING_KEY if key is None else INVALID_KEY
