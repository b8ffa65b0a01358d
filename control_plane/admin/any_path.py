"""The ``anypath`` URL convertor: Starlette's ``path``, newlines included.

Starlette's ``path`` convertor is ``.*``, whose ``.`` stops at a newline:
``PUT /v1/rollouts/a%0Ab`` (a rollout's alias may contain '/') matched no route
and got a bare 404 "Not Found" (schemathesis found it). Matched, the value meets
its parameter's own validation: a 422 naming the alias and its pattern. Routes
write ``{name:anypath}``; ``/openapi.json`` shows ``{name}`` as before.
"""

from __future__ import annotations

from starlette.convertors import PathConvertor, register_url_convertor

ANY_PATH = "anypath"


class AnyPathConvertor(PathConvertor):
    """``path``, newlines included."""

    regex = "(?s:.*)"


# Starlette's table of convertors is global: registering the same convertor again changes nothing.
register_url_convertor(ANY_PATH, AnyPathConvertor())
