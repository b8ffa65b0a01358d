"""Parsing OpenAI embeddings requests: every shape accepted, every mistake named."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from workers.protocol import APIError, embeddings_response, parse_embeddings_request


def parse(doc: object, max_inputs: int = 8):  # type: ignore[no-untyped-def]
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return parse_embeddings_request(body, max_inputs=max_inputs, vocab_size=100)


@pytest.mark.parametrize(
    ("doc", "texts", "ids"),
    [
        ({"input": "hi", "model": "m"}, ("hi",), None),
        ({"input": ""}, ("",), None),  # [CLS] [SEP]: a valid input, as in the reference
        ({"input": ["a", "b"]}, ("a", "b"), None),
        ({"input": [1, 2, 3]}, None, ((1, 2, 3),)),
        ({"input": [[1, 2], [3]]}, None, ((1, 2), (3,))),
    ],
)
def test_accepted_input_shapes(doc, texts, ids) -> None:  # type: ignore[no-untyped-def]
    req = parse(doc)
    assert req.texts == texts
    assert req.token_ids == ids
    assert req.encoding_format == "float" and req.truncate is True


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        ({"model": "m"}, "missing required field 'input'"),
        ({"input": []}, "empty list"),
        ({"input": 5}, "got int"),
        ({"input": [{"a": 1}]}, "input[0] is dict"),
        ({"input": ["a", 1]}, "input[1] must be a string"),
        ({"input": [1, "a"]}, "input[1] must be an integer"),
        ({"input": [1, True]}, "input[1] must be an integer"),
        ({"input": [[1], 2]}, "input[1] must be a token array"),
        ({"input": [[1], []]}, "input[1] is an empty token array"),
        ({"input": [1, 100]}, "not a token id of this model"),
        ({"input": [-1]}, "not a token id of this model"),
        ({"input": ["x"] * 9}, "9 items, more than the limit of 8"),
        ({"input": "x", "encoding_format": "hex"}, "'encoding_format' must be"),
        ({"input": "x", "truncate": "no"}, "'truncate' must be a boolean"),
        ({"input": "x", "dimensions": "384"}, "'dimensions' must be an integer"),
        ({"input": "x", "model": 3}, "'model' must be a string"),
        ({"input": "x", "temperature": 1}, "unknown field(s): temperature"),
    ],
)
def test_bad_requests_name_the_problem(body, fragment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400
    assert fragment in info.value.message
    error = orjson.loads(info.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


def test_response_float_and_base64_carry_the_same_vectors() -> None:
    vectors = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    as_float = orjson.loads(embeddings_response(vectors, model="m", prompt_tokens=7, encoding_format="float"))
    as_b64 = orjson.loads(embeddings_response(vectors, model="m", prompt_tokens=7, encoding_format="base64"))
    assert as_float["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in as_float["data"]] == [0, 1, 2]
    for i, (f, b) in enumerate(zip(as_float["data"], as_b64["data"])):
        np.testing.assert_allclose(f["embedding"], vectors[i], rtol=1e-6)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, vectors[i])
