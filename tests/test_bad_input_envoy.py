"""Bad input through the real stack (issue 20): property-based and fuzzed requests sent to Envoy, which hands
them to ext_proc and a real all-MiniLM-L6-v2 worker. API keys are required (the stricter variant: ext_proc
sees every request and fails closed), so every body carries a valid key except in the key category.

The properties, for every generated request:
- never a 5xx: whatever a client sends is its own mistake (4xx) or a request served (200);
- every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` as application/json;
- every process is alive afterwards, no stream failed in ext_proc, and nothing is left in flight.

Also: slow clients (slowloris) holding many connections half-sent do not starve the others.

One module-scoped stack for the whole run. Generation is bounded and derandomized (no example database), so
CI runs the same cases every time; the cases tried per category are written to ``bad-input-counts.json`` in
the run's log directory (and to ``$INFERLB_BAD_INPUT_COUNTS`` when set: docs/reliability.md's table).
"""

from __future__ import annotations

from http.client import HTTPResponse, RemoteDisconnected
import json
import os
import socket
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

from inferlb_runtime.request_class import OBJECTIVE_HEADER, TIMEOUT_HEADER

from .conftest import WorkerProcess, free_port, running_worker
from .stack import ControlPlane, Envoy, ExtProc, Proc, http, running_control_plane, running_envoy, \
    running_ext_proc, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

ENVOY_LIMIT = 2 * 1024 * 1024  # the route's body buffer limit: beyond it, Envoy's own 413
EXT_PROC_LIMIT = 1024 * 1024  # ext_proc's cap, below Envoy's so both 413s are reached
VOCAB = 30522  # all-MiniLM-L6-v2's vocabulary: token ids 0..30521
MAX_INPUTS = 2048  # the worker's default max_inputs
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Stack:
    worker: WorkerProcess
    worker_proc: Proc
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy
    key: str
    log_dir: Path
    # (category, status) -> requests: the figures for docs/reliability.md
    tally: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def procs(self) -> list[Proc]:
        return [self.cp.proc, self.ext_proc.proc, self.envoy.proc, self.worker_proc]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cp.listener_port}/v1/embeddings"

    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


@contextmanager
def _as_proc(worker: WorkerProcess) -> Iterator[Proc]:
    """The conftest worker as a ``Proc`` (its liveness and log for the checks here)."""
    yield Proc("worker", worker.process, worker.log_path)


@pytest.fixture(scope="module")
def stack(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("bad-input")
    ext_proc_port = free_port()
    with ExitStack() as exits:
        worker = exits.enter_context(running_worker(data_dir, log_dir))
        worker_proc = exits.enter_context(_as_proc(worker))
        wid = worker.url.removeprefix("http://")
        cp = exits.enter_context(running_control_plane(
            log_dir, endpoints=[wid], ext_proc_port=ext_proc_port,
            env={"INFERLB_CP_DATA_PLANE__MAX_REQUEST_BODY_BYTES": str(ENVOY_LIMIT),
                 "INFERLB_CP_DATA_PLANE__REQUIRE_API_KEYS": "true"}))
        ext_proc = exits.enter_context(running_ext_proc(
            log_dir, xds_port=cp.xds_port, port=ext_proc_port, node_id="ext-proc-bad-input",
            env={"INFERLB_EXT_PROC_MAX_BODY_BYTES": str(EXT_PROC_LIMIT), "INFERLB_EXT_PROC_REQUIRE_API_KEYS": "true"}))
        envoy = exits.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-bad-input"))
        procs = [cp.proc, ext_proc.proc, envoy.proc, worker_proc]
        wait_for(lambda: envoy.healthy_hosts() == {wid}, 30, "Envoy to see the worker healthy", procs)
        with http() as client:
            created = client.post(f"{cp.admin_url}/v1/api-keys", json={"tenant": "fuzz"},
                                  headers={"authorization": f"Bearer {cp.admin_token()}"})
        assert created.status_code == 201, created.text
        s = Stack(worker, worker_proc, cp, ext_proc, envoy, created.json()["key"], log_dir)

        def served() -> bool:  # until ext_proc has the pushed key table: 401
            with http() as client:
                return client.post(s.url, json={"input": "warm up"}, headers=s.auth(), timeout=30).status_code == 200
        wait_for(served, 30, "a first 200 with the new key", procs)
        yield s
        _write_counts(s)


def _write_counts(s: Stack) -> None:
    counts: dict[str, dict[str, int]] = {}
    for (category, status), n in sorted(s.tally.items()):
        counts.setdefault(category, {})[str(status)] = n
    text = json.dumps(counts, indent=2, sort_keys=True) + "\n"
    (s.log_dir / "bad-input-counts.json").write_text(text)
    if out := os.environ.get("INFERLB_BAD_INPUT_COUNTS"):
        Path(out).write_text(text)


# --- the property ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def exchange(port: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Answer:
    """One POST written byte for byte (any header bytes at all: an HTTP library would refuse some), its answer
    read by the standard library's parser."""
    head = [b"POST /v1/embeddings HTTP/1.1", f"host: 127.0.0.1:{port}".encode(), b"connection: close",
            f"content-length: {len(body)}".encode(), *(name + b": " + value for name, value in headers)]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        response = HTTPResponse(sock)
        response.begin()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())


def check_answer(response: Answer) -> None:
    """No 5xx; an error is OpenAI's shape as JSON; a 200 is a list of embeddings."""
    assert response.status < 500, (response.status, response.headers, response.body[:2000])
    assert response.headers.get("content-type", "").startswith("application/json"), \
        (response.status, response.headers, response.body[:500])
    body = response.json()
    if response.status == 200:
        assert body["object"] == "list" and body["data"], response.body[:500]
        return
    assert 400 <= response.status < 500, (response.status, response.body[:500])
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def _bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("latin-1")


# Bytes HTTP forbids in a header value (RFC 9110 5.5: controls but HTAB). Envoy's codec rejects the request;
# its 400 is then held by ext_proc's response-headers step while the codec closes the connection, so the client
# sees a close without an answer (envoyproxy/envoy#29440, open upstream). Checked as such: closed, nothing else.
FORBIDDEN = frozenset(range(0x20)) - {0x09} | {0x7F}
CLOSED = 0  # the tally's "status" for a connection closed without an answer


def send(s: Stack, category: str, body: bytes, headers: dict[str, str | bytes] | None = None, *,
         auth: bool = True) -> Answer:
    sent = [(_bytes(k), _bytes(v)) for k, v in
            {"content-type": "application/json", **(s.auth() if auth else {}), **(headers or {})}.items()]
    if any(FORBIDDEN.intersection(value) for _, value in sent):
        with pytest.raises(RemoteDisconnected):
            exchange(s.cp.listener_port, body, sent)
        s.tally[(category, CLOSED)] += 1
        return Answer(CLOSED, {}, b"")
    response = exchange(s.cp.listener_port, body, sent)
    s.tally[(category, response.status)] += 1
    check_answer(response)
    return response


def fuzz(max_examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Bounded, derandomized, no database: CI runs the same cases every time, and does not shrink (a failure
    is reported with the example that found it)."""
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


# --- strategies ------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ("input", "model", "encoding_format", "truncate", "dimensions", "user")


def _not_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return True
    return False


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# --- the categories --------------------------------------------------------------------------------


def test_invalid_json(stack: Stack) -> None:
    valid = b'{"input": ["a sentence", "another"], "model": "all-MiniLM-L6-v2"}'

    @given(st.one_of(st.binary(max_size=300),
                     st.text(alphabet='{}[]":,.-+eE0123456789 truefalsnul\\x\t', max_size=80).map(str.encode),
                     st.integers(1, len(valid) - 1).map(lambda n: valid[:n])).filter(_not_json))
    @example(b"{'input': 'single quotes'}")
    @example(b'{"input": "a", }')
    @example(b'{"input": NaN}')
    @fuzz(30)
    def check(body: bytes) -> None:
        assert send(stack, "invalid JSON", body).status == 400

    check()


def test_wrong_types(stack: Stack) -> None:
    @given(st.one_of(
        st.fixed_dictionaries({}, optional={name: json_values for name in FIELDS}),
        st.fixed_dictionaries({"input": st.text(max_size=30)}, optional={name: json_values for name in FIELDS[1:]}),
        st.dictionaries(st.text(max_size=10), json_values, max_size=4),
        json_values.filter(lambda v: not isinstance(v, dict))))
    @example({"input": "x", "dimensions": 0})
    @example({"input": "x", "dimensions": -1})
    @example({"input": "x", "dimensions": 10 ** 6})
    @example({"input": "x", "encoding_format": None, "truncate": None})
    @example({"input": {"nested": "object"}})
    @example({"input": "x", "user": ["a"]})
    @fuzz(40)
    def check(doc: Any) -> None:
        send(stack, "wrong types", dumps(doc))

    check()


def _long_string(n: int) -> bytes:
    return b'{"input": "' + (b"word " * (n // 5 + 1))[:n] + b'"}'


@st.composite
def huge_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["long string", "too many inputs", "long token array", "many token arrays",
                                 "big object"]))
    if kind == "long string":  # within the caps: truncated by the worker, served
        return _long_string(draw(st.integers(1, EXT_PROC_LIMIT - 64)))
    if kind == "too many inputs":
        return dumps({"input": ["x"] * draw(st.integers(MAX_INPUTS + 1, 100_000))})
    if kind == "long token array":
        return dumps({"input": [101] * draw(st.integers(1, 100_000))})
    if kind == "many token arrays":
        return dumps({"input": [[101, 102]] * draw(st.integers(MAX_INPUTS + 1, 50_000))})
    return dumps({"input": "x", **{f"k{i}": i for i in range(draw(st.integers(1, 20_000)))}})


def test_huge_arrays_and_strings(stack: Stack) -> None:
    @given(huge_bodies())
    @example(_long_string(EXT_PROC_LIMIT + EXT_PROC_LIMIT // 2))  # over ext_proc's cap: its 413
    @example(_long_string(ENVOY_LIMIT + 1024))  # over Envoy's: Envoy's 413
    @example(_long_string(3 * ENVOY_LIMIT))
    @example(dumps({"input": ["a sentence"] * 256}))  # a big batch within the limits: served
    @example(dumps({"input": ["x"] * 200_000}))  # ~0.5 s to count, past Envoy's message_timeout: was a 504
    @fuzz(12)
    def check(body: bytes) -> None:
        note(f"{len(body)} bytes: {body[:60]!r}...{body[-20:]!r}")
        response = send(stack, "huge arrays and strings", body)
        if len(body) > EXT_PROC_LIMIT:
            assert response.status == 413

    check()


@st.composite
def deep_bodies(draw: st.DrawFn) -> bytes:
    depth = draw(st.integers(3, 200_000))  # [[1]] and less: a token array, served
    shape = draw(st.sampled_from(["arrays", "objects", "unclosed", "mixed"]))
    if shape == "arrays":
        return b'{"input": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    if shape == "objects":
        return b'{"input": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if shape == "unclosed":
        return b'{"input": ' + b"[" * depth
    return b'{"input": [' + b'[{"a": ' * depth + b'"x"' + b"}]" * depth + b"]}"


def test_deep_nesting(stack: Stack) -> None:
    @given(deep_bodies())
    @example(b"[" * 100_000 + b"]" * 100_000)
    @fuzz(20)
    def check(body: bytes) -> None:
        assert send(stack, "deep nesting", body).status in (400, 413)

    check()


INVALID_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                b"\xc0\xaf", b"\xf4\x90\x80\x80"]


@st.composite
def bad_utf8_bodies(draw: st.DrawFn) -> bytes:
    pieces = draw(st.lists(st.one_of(st.sampled_from(INVALID_UTF8),
                                     st.text(max_size=5).map(lambda t: t.replace('"', "").replace("\\", "").encode())),
                           min_size=1, max_size=8))
    text = b"".join(pieces)
    if not any(bad in text for bad in INVALID_UTF8):
        text += b"\xff"
    where = draw(st.sampled_from(["input", "list", "model", "key", "user"]))
    if where == "input":
        return b'{"input": "' + text + b'"}'
    if where == "list":
        return b'{"input": ["ok", "' + text + b'"]}'
    if where == "model":
        return b'{"input": "ok", "model": "' + text + b'"}'
    if where == "key":
        return b'{"input": "ok", "' + text + b'": 1}'
    return b'{"input": "ok", "user": "' + text + b'"}'


def test_invalid_utf8(stack: Stack) -> None:
    @given(bad_utf8_bodies())
    @example(b'{"input": "\\ud800"}')  # valid JSON, a lone surrogate: not a Unicode string
    @example(b'{"input": ["\\udfff", "x"]}')
    @example(b'{"input": "ok", "model": "\\ud83d"}')
    @fuzz(25)
    def check(body: bytes) -> None:
        send(stack, "invalid UTF-8", body)

    check()


EMPTY = [b"", b" ", b"\n", b"null", b"{}", b"[]", b'""', b'{"input": ""}', b'{"input": []}', b'{"input": [""]}',
         b'{"input": [[]]}', b'{"input": null}', b'{"input": "   "}', b'{"input": ["", ""]}', b'{"model": ""}']


def test_empty_input(stack: Stack) -> None:
    for body in EMPTY:
        send(stack, "empty input", body)


@st.composite
def token_bodies(draw: st.DrawFn) -> bytes:
    ids = st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.integers(VOCAB - 3, VOCAB + 3), st.integers(-3, 3),
                    st.sampled_from([2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64]))
    oddities = st.one_of(ids, st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                         st.text(max_size=3))
    shape = draw(st.sampled_from(["flat", "nested", "mixed", "ragged"]))
    if shape == "flat":
        value: Any = draw(st.lists(ids, min_size=1, max_size=40))
    elif shape == "nested":
        value = draw(st.lists(st.lists(ids, max_size=20), min_size=1, max_size=6))
    elif shape == "mixed":
        value = draw(st.lists(oddities, min_size=1, max_size=20))
    else:
        value = draw(st.lists(st.one_of(ids, st.lists(ids, max_size=5)), min_size=1, max_size=10))
    return dumps({"input": value})


def test_out_of_range_token_ids(stack: Stack) -> None:
    @given(token_bodies())
    @example(dumps({"input": [VOCAB]}))
    @example(dumps({"input": [-1]}))
    @example(dumps({"input": [[101], [VOCAB + 10]]}))
    @example(dumps({"input": [2 ** 64]}))
    @fuzz(30)
    def check(body: bytes) -> None:
        send(stack, "token ids", body)

    check()


header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
# any byte but the line ends (those would end the header, not make it bad): controls, NUL, obs-text
raw_header_value = st.binary(max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def test_wrong_content_types(stack: Stack) -> None:
    @given(st.one_of(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "application/xml",
                                      "multipart/form-data; boundary=x", "application/octet-stream", "",
                                      "application/json; charset=latin-1", "*/*", "application/json, text/plain"]),
                     header_text),
           st.sampled_from([b'{"input": "a sentence"}', b"input=a+sentence", b"<input>a</input>",
                            b"--x\r\nContent-Disposition: form-data; name=input\r\n\r\na\r\n--x--\r\n"]))
    @fuzz(20)
    def check(content_type: str, body: bytes) -> None:
        send(stack, "content types", body, {"content-type": content_type})

    check()


def test_bad_headers(stack: Stack) -> None:
    body = b'{"input": "a sentence"}'
    names = st.sampled_from([OBJECTIVE_HEADER, TIMEOUT_HEADER, "x-envoy-expected-rq-timeout-ms",
                             "x-gateway-destination-endpoint", "x-inferlb-model", "x-inferlb-tokens",
                             "cache-control", "traceparent", "x-request-id", "x-forwarded-for", "te"])
    values = st.one_of(header_text, raw_header_value, st.sampled_from(["-1", "0", "1e309", "nan", "inf", "99999999999999999999",
                                                     "127.0.0.1:1", "[::1]:1", "critical", "no-store, no-cache"]),
                       st.binary(min_size=1, max_size=20).map(lambda b: bytes(c | 0x80 for c in b)))

    @given(st.dictionaries(names, values, min_size=1, max_size=3))
    @fuzz(25)
    def check(headers: dict[str, Any]) -> None:
        note(repr(headers))
        send(stack, "headers", body, headers)

    check()


def test_bad_api_keys(stack: Stack) -> None:
    body = b'{"input": "a sentence"}'
    key = stack.key
    wrong = st.one_of(
        header_text.map(lambda t: f"Bearer {t}"), header_text, raw_header_value.map(lambda b: b"Bearer " + b),
        st.sampled_from([f"Bearer {key}x", f"Bearer {key[:-1]}", f"Bearer {key[:8]}", f"Basic {key}", "Bearer ",
                         "Bearer", f"Token {key}", f"{key}", f"Bearer {key.upper()}"]),
        st.integers(1, 40_000).map(lambda n: "Bearer " + "k" * n))

    @given(wrong)
    @example(None)  # no Authorization header at all
    @fuzz(25)
    def check(authorization: str | None) -> None:
        headers = {} if authorization is None else {"authorization": authorization}
        response = send(stack, "API keys", body, headers, auth=False)
        assert response.status in (CLOSED, 400, 401, 431), response.body  # never served without a valid key
        if response.status == 401:
            assert response.json()["error"]["code"] == "invalid_api_key"

    check()


# --- slow clients ----------------------------------------------------------------------------------

SLOW_CONNECTIONS = 60  # half of them dribbling headers, half a body


class Dribbler:
    """Slow clients: each connection sends its request a byte at a time, one byte per connection per round,
    until stopped. A thread; always stopped and its sockets closed by the context manager."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.sockets: list[tuple[socket.socket, bytes]] = []
        head = (f"POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
                "x-slow: ").encode()
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:  # headers complete, then a body that never ends
                sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                             "content-type: application/json\r\ncontent-length: 100000\r\n\r\n".encode())
                self.sockets.append((sock, b'{"input": "' + b"z" * 99_980))
            else:  # headers that never end
                sock.sendall(head)
                self.sockets.append((sock, b"a" * 100_000))
        self.stopped = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def _run(self) -> None:
        position = 0
        while not self.stopped.wait(0.2):  # the clients' pace (a byte per connection per 0.2 s), not a wait
            for sock, rest in self.sockets:
                try:
                    sock.sendall(rest[position:position + 1])
                    self.sent += 1
                except OSError:  # Envoy closed it (its headers timeout): that is allowed
                    pass
            position += 1

    def __enter__(self) -> "Dribbler":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(30)
        for sock, _ in self.sockets:
            sock.close()


def _envoy_stat(envoy: Envoy, name: str) -> int:
    for line in envoy.admin(f"/stats?filter=^{name}$").splitlines():
        if line.startswith(f"{name}: "):
            return int(line.split(": ", 1)[1])
    return 0


def test_slow_clients_do_not_starve_the_others(stack: Stack) -> None:
    active = "http.inferlb_http.downstream_cx_active"
    before = _envoy_stat(stack.envoy, active)
    with Dribbler(stack.cp.listener_port, SLOW_CONNECTIONS) as slow:
        wait_for(lambda: _envoy_stat(stack.envoy, active) >= before + SLOW_CONNECTIONS, 30,
                 "Envoy to hold every slow connection", stack.procs)
        wait_for(lambda: slow.sent >= 2 * SLOW_CONNECTIONS, 30, "the slow clients to be sending", stack.procs)
        with http() as client:
            codes = Counter(client.post(stack.url, json={"input": f"a normal request {i}"}, headers=stack.auth(),
                                        timeout=30).status_code for i in range(30))
        assert codes == {200: 30}, codes
        assert _envoy_stat(stack.envoy, active) >= before + SLOW_CONNECTIONS // 2  # they were still open meanwhile
    wait_for(lambda: stack.ext_proc.outstanding() == 0, 30, "ext_proc to release the slow requests", stack.procs)


# --- afterwards ------------------------------------------------------------------------------------


def test_every_process_survived_and_nothing_is_left_in_flight(stack: Stack) -> None:
    for proc in stack.procs:
        proc.check_alive()
    wait_for(lambda: stack.ext_proc.outstanding() == 0, 30, "ext_proc's in-flight count back to 0", stack.procs)
    for proc in (stack.ext_proc.proc, stack.cp.proc, stack.worker_proc):
        assert "Traceback" not in proc.log(), proc.tail(40)
    assert not any(status >= 500 for _, status in stack.tally), stack.tally
