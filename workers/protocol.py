"""The OpenAI embeddings wire format: parsing requests, shaping responses and errors.

Parsing is strict and says exactly what is wrong, because a load balancer's
users debug through it: a vague 400 from behind a proxy costs hours.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import orjson

from .model_catalog import ModelInfo

EncodingFormat = Literal["float", "base64"]


class APIError(Exception):
    """An error the client should see, in OpenAI's ``{"error": {...}}`` shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(message: str, *, type: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A request whose fields and shape are valid: either texts or token-id arrays, never both.

    From :func:`parse_request_shape` the arrays are the client's lists, their
    ids not yet read (:func:`check_token_ids` does that, on the ids a request
    keeps); from :func:`parse_embeddings_request` every id has been checked.
    ``single_array`` says the input was one bare token array (errors then name
    ``input[j]`` rather than ``input[i][j]``).
    """

    model: str | None
    texts: tuple[str, ...] | None
    token_ids: tuple[Sequence[int], ...] | None
    encoding_format: EncodingFormat
    truncate: bool
    dimensions: int | None
    single_array: bool = False

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


_KNOWN_FIELDS = {"input", "model", "encoding_format", "truncate", "dimensions", "user"}


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(arrays: Sequence[Sequence[int]], vocab_size: int, *, single_array: bool = False) -> None:
    """Raise a 400 naming the first id that is not an integer token id of the vocabulary.

    The one per-token pass of a request, so it runs only after every cheap
    bound has passed, on the ids the request keeps. The common case (all
    valid) is checked by C-level builtins; the Python loop that names the
    culprit runs only when that check fails.
    """
    for i, ids in enumerate(arrays):
        if not ids or (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab_size):
            continue
        where = "input" if single_array else f"input[{i}]"
        for j, tok in enumerate(ids):
            if not _is_int(tok):
                raise _bad(f"{where}[{j}] must be an integer token id, got {type(tok).__name__}", "input")
            if not 0 <= tok < vocab_size:
                raise _bad(f"{where}[{j}] = {tok} is not a token id of this model (0..{vocab_size - 1})", "input")


def parse_embeddings_request(body: bytes, *, max_inputs: int, vocab_size: int) -> EmbeddingsRequest:
    """Validate a raw request body completely, every token id included; raise :class:`APIError` (400).

    The worker itself parses in stages (:func:`parse_request_shape`, its
    limits, then :func:`check_token_ids` on what it keeps); this is the whole
    check in one call, for callers that hold a body of known size.
    """
    request = parse_request_shape(body, max_inputs=max_inputs)
    if request.token_ids is None:
        return request
    check_token_ids(request.token_ids, vocab_size, single_array=request.single_array)
    return dataclasses.replace(request, token_ids=tuple(tuple(ids) for ids in request.token_ids))


def parse_request_shape(body: bytes, *, max_inputs: int) -> EmbeddingsRequest:
    """Check a body's fields and the shape of its input, at a cost in the number of inputs, never of tokens.

    Token arrays are checked to be non-empty lists; their ids are left to
    :func:`check_token_ids`, so that a request over the token limit is refused
    from its arrays' lengths before any id is read.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise _bad(f"request body must be a JSON object, got {type(doc).__name__}", code="invalid_json")
    unknown = set(doc) - _KNOWN_FIELDS
    if unknown:
        raise _bad(f"unknown field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0], "unknown_field")
    if "input" not in doc:
        raise _bad("missing required field 'input'", "input", "missing_field")

    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    encoding_format = doc.get("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        raise _bad(f"'encoding_format' must be 'float' or 'base64', got {encoding_format!r}", "encoding_format")
    truncate = doc.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _bad("'truncate' must be a boolean", "truncate")
    dimensions = doc.get("dimensions")
    if dimensions is not None and not _is_int(dimensions):
        raise _bad("'dimensions' must be an integer", "dimensions")
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")

    raw = doc["input"]
    texts: tuple[str, ...] | None = None
    token_ids: tuple[list[Any], ...] | None = None
    single_array = False
    if isinstance(raw, str):
        texts = (raw,)
    elif isinstance(raw, list):
        if not raw:
            raise _bad("'input' is an empty list", "input", "empty_input")
        if len(raw) > max_inputs:
            raise _bad(f"'input' has {len(raw)} items, more than the limit of {max_inputs}", "input", "too_many_inputs")
        first = raw[0]
        if _is_int(first):
            token_ids, single_array = (raw,), True
        elif isinstance(first, str):
            for i, item in enumerate(raw):
                if not isinstance(item, str):
                    raise _bad(f"input[{i}] must be a string like input[0], got {type(item).__name__}", "input")
            texts = tuple(raw)
        elif isinstance(first, list):
            for i, item in enumerate(raw):
                if not isinstance(item, list):
                    raise _bad(f"input[{i}] must be a token array like input[0], got {type(item).__name__}", "input")
                if not item:
                    raise _bad(f"input[{i}] is an empty token array", "input")
            token_ids = tuple(raw)
        else:
            raise _bad(
                "'input' must be a string, a list of strings, a token array or a list of token arrays; "
                f"input[0] is {type(first).__name__}",
                "input",
            )
    else:
        raise _bad(
            "'input' must be a string, a list of strings, a token array or a list of token arrays, "
            f"got {type(raw).__name__}",
            "input",
        )
    return EmbeddingsRequest(model, texts, token_ids, encoding_format, truncate, dimensions, single_array)


def embeddings_response(
    vectors: np.ndarray, *, model: str, prompt_tokens: int, encoding_format: EncodingFormat
) -> bytes:
    """Serialise an OpenAI ``list`` of embeddings (float32 rows, or base64 of little-endian float32)."""
    data: list[dict[str, Any]] = []
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    for i, row in enumerate(vectors):
        embedding: Any = base64.b64encode(row.tobytes()).decode() if encoding_format == "base64" else row
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def models_response(models: Sequence[ModelInfo], created: int) -> bytes:
    """OpenAI's model list; each entry also says its family and the aliases it answers to."""
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"id": m.name, "object": "model", "created": created, "owned_by": "inferlb",
                      "family": m.family, "aliases": sorted(m.aliases)} for m in models],
        }
    )
