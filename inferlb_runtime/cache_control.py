"""``Cache-Control`` on the inference path: what one request lets the caches do.

Both caches read the same header the same way: ext_proc's gateway cache (whole answers) and the worker's
per-input cache. ``no-cache`` skips the lookup (the fresh answer may still be stored: the client wants a
fresh computation, not to keep others from the result); ``no-store`` skips both. Other directives
(``max-age`` and the like) mean nothing to a cache of deterministic results and are ignored, as HTTP
says unknown ones are.
"""

from __future__ import annotations

from dataclasses import dataclass

CACHE_CONTROL_HEADER = "cache-control"
CACHE_STATUS_HEADER = "x-inferlb-cache"  # on every answer through ext_proc: hit or miss


@dataclass(frozen=True, slots=True)
class CacheDirectives:
    no_cache: bool = False
    no_store: bool = False

    @property
    def lookup(self) -> bool:
        return not (self.no_cache or self.no_store)

    @property
    def store(self) -> bool:
        return not self.no_store


NO_DIRECTIVES = CacheDirectives()


def parse_cache_control(value: str | None) -> CacheDirectives:
    """The directives in a ``Cache-Control`` value (case-insensitive tokens)."""
    if not value:
        return NO_DIRECTIVES
    tokens = {part.split("=", 1)[0].strip().lower() for part in value.split(",")}
    return CacheDirectives(no_cache="no-cache" in tokens, no_store="no-store" in tokens)
