"""Size-aware admission through the real wire: Envoy, the control plane, ext_proc and a real ONNX worker.

The door is made to hold every request of its size class but one (an admission budget of a millisecond:
a hog or a paragraph enters only at an idle worker), so the worker runs them one at a time, in the order
ext_proc lets them through: the order the client sees them completed is the admission order. Each test
queues "hogs" (about 1,600 tokens of unique sentences, so no cache answers) behind a long one in flight,
then sends a "paragraph" (about 600 tokens: a smaller request of the same size class, which waits behind
them) or a one-sentence request, and asserts the order and the outcomes, never a time:

- a sentence does not wait behind hogs at all: it fits beside them (the workers serve it first);
- least work first: a paragraph overtakes the hogs its own client queued before it;
- aging: with aging so fast that a hog's size is worth microseconds, a paragraph sent later waits its turn;
- one flow per client: in first-in-first-out order, another client's paragraph still goes before the
  first client's queued hogs (its own paragraph does not);
- early refusal: a request whose predicted wait is past the maximum is answered 429 at once, with a
  Retry-After from that prediction, and counted as such.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from inferlb.bench.processes import free_ports

from .conftest import running_worker
from .stack import (
    ControlPlane,
    Envoy,
    ExtProc,
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

HOG_INPUTS, HOG_WORDS = 16, 100  # a hog: 16 sentences of about 100 tokens, a fraction of a second on one core
PARAGRAPH_INPUTS = 6  # a paragraph: 6 such sentences, about 600 tokens: the hogs' size class, smaller
# The first hog holds the worker while the others queue: 128 inputs of 256 tokens, seconds on one core, so
# that the rest of the scene is set long before it ends (a wait_for fails loudly if it ever is not).
FIRST_INPUTS, FIRST_WORDS = 128, 250
# The order tests wait as long as it takes on a loaded host: no refusal at once, a maximum wait of 50 s,
# and Envoy told to wait for ext_proc that long (its max_message_timeout, 60 s here).
PATIENT = {"INFERLB_EXT_PROC_EARLY_REFUSAL": "false", "INFERLB_EXT_PROC_FAIR_QUEUE_MAX_WAIT_S": "50"}
CP_ENV = {"INFERLB_CP_DATA_PLANE__EXT_PROC_MAX_MESSAGE_TIMEOUT_MS": "60000"}
WORDS = ("cat", "mat", "river", "stone", "cloud", "lamp", "tree", "bird", "road", "glass", "field", "storm")


@dataclass
class Door:
    url: str
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy
    worker_id: str
    done: list[str] = field(default_factory=list)  # names, in the order their answers came
    lock: threading.Lock = field(default_factory=threading.Lock)
    answers: dict[str, httpx.Response] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def procs(self) -> list:
        return [self.cp.proc, self.ext_proc.proc, self.envoy.proc]

    def send(self, name: str, inputs: list[str], address: str = "127.0.0.1") -> None:
        """Post in a thread from ``address``; record when the answer came."""
        def post() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=address)) as client:
                response = client.post(self.url, json={"model": "all-MiniLM-L6-v2", "input": inputs}, timeout=120)
            with self.lock:
                self.done.append(name)
                self.answers[name] = response

        thread = threading.Thread(target=post, name=name)
        thread.start()
        self.threads.append(thread)

    def queued(self) -> float:
        return sample(self.ext_proc.metrics(), "inferlb_ext_proc_fair_queue_depth", tenant="anonymous") or 0.0

    def in_flight(self) -> float:
        return sample(self.ext_proc.metrics(), "inferlb_ext_proc_outstanding_requests", endpoint=self.worker_id) \
            or 0.0

    def join(self) -> None:
        for thread in self.threads:
            thread.join(180)
        assert not any(t.is_alive() for t in self.threads), "a request never came back"


_unique = itertools.count()


def sentences(n: int, words: int) -> list[str]:
    """``n`` sentences no cache has seen (a serial number in each)."""
    rng = random.Random(next(_unique))
    return [f"{next(_unique)} " + " ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


@contextmanager
def door(tmp_path: Path, data_dir: Path, env: Mapping[str, str]) -> Iterator[Door]:
    """One real int8 worker behind Envoy and ext_proc, whose door lets one request in at a time."""
    with ExitStack() as stack:
        worker = stack.enter_context(running_worker(data_dir, tmp_path, "--threads", "1",
                                                    "--max-request-tokens", "65536"))
        worker_id = worker.url.removeprefix("http://")
        xds_port, admin_port, listener_port, ext_proc_port = free_ports(4)
        cp = stack.enter_context(running_control_plane(tmp_path, endpoints=[worker_id], xds_port=xds_port,
                                                       admin_port=admin_port, listener_port=listener_port,
                                                       ext_proc_port=ext_proc_port, env=CP_ENV))
        ext_proc = stack.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port,
                                                        node_id="ext-proc-door", env={
                                                            "INFERLB_EXT_PROC_ADMISSION_BUDGET_S": "0.001",
                                                            "INFERLB_EXT_PROC_SLOW_START_S": "0", **env}))
        envoy = stack.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-door"))
        d = Door(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings", cp, ext_proc, envoy, worker_id)
        wait_for(lambda: envoy.healthy_hosts() == {worker_id}, 60, "Envoy to see the worker healthy", d.procs)

        def routed() -> bool:
            with http() as client:
                response = client.post(d.url, json={"input": sentences(1, 5)}, timeout=60)
            return response.status_code == 200 and response.headers.get("x-inferlb-endpoint") == worker_id

        wait_for(routed, 60, "ext_proc to route to the worker", d.procs)
        try:
            yield d
        finally:
            d.join()


def hold_the_worker(d: Door, address: str = "127.0.0.1") -> None:
    d.send("hog0", sentences(FIRST_INPUTS, FIRST_WORDS), address)
    wait_for(lambda: d.in_flight() == 1, 60, lambda: f"the first hog to hold the worker (answers: {[(n, r.status_code, r.text[:300]) for n, r in d.answers.items()]})",
             d.procs)


def queue_hogs(d: Door, count: int, address: str = "127.0.0.1") -> None:
    """One long hog in flight and ``count - 1`` hogs waiting at the door."""
    hold_the_worker(d, address)
    for i in range(1, count):
        d.send(f"hog{i}", sentences(HOG_INPUTS, HOG_WORDS), address)
    wait_for(lambda: d.queued() == count - 1, 60,
             lambda: f"{count - 1} hogs to wait at the door (queued {d.queued()}, in flight {d.in_flight()}, "
                     f"answered {[(n, d.answers[n].status_code, d.answers[n].text[:200]) for n in d.done]})", d.procs)


def test_smaller_requests_overtake_the_hogs_their_own_client_queued_before_them(tmp_path: Path,
                                                                                 data_dir: Path) -> None:
    # 10 tokens a second of aging: a hog (about 1,600 tokens) is overtaken for minutes after it came.
    with door(tmp_path, data_dir, {**PATIENT, "INFERLB_EXT_PROC_FAIR_QUEUE_SIZE_RATE": "10"}) as d:
        queue_hogs(d, 4)
        d.send("paragraph", sentences(PARAGRAPH_INPUTS, HOG_WORDS))
        wait_for(lambda: d.queued() == 4, 60, "the paragraph to wait at the door", d.procs)
        d.send("sentence", sentences(1, 6))
        d.join()
        assert all(r.status_code == 200 for r in d.answers.values()), d.answers
        order = d.done
        # The paragraph waits in its size class, first: it goes before hog1..3.
        assert all(order.index("paragraph") < order.index(f"hog{i}") for i in (1, 2, 3)), order
        # The sentence waits behind none of them: it fits beside the hogs.
        assert all(order.index("sentence") < order.index(f"hog{i}") for i in (1, 2, 3)), order


def test_an_aged_hog_goes_before_a_paragraph_sent_after_it(tmp_path: Path, data_dir: Path) -> None:
    # A billion tokens a second: a hog's size is worth microseconds of waiting, so arrival order wins.
    with door(tmp_path, data_dir, {**PATIENT, "INFERLB_EXT_PROC_FAIR_QUEUE_SIZE_RATE": "1000000000"}) as d:
        queue_hogs(d, 3)
        d.send("paragraph", sentences(PARAGRAPH_INPUTS, HOG_WORDS))
        d.join()
        assert all(r.status_code == 200 for r in d.answers.values()), d.answers
        assert d.done[0] == "hog0" and d.done[-1] == "paragraph", d.done  # behind every hog queued before it


def test_each_client_without_a_key_is_its_own_flow(tmp_path: Path, data_dir: Path) -> None:
    with door(tmp_path, data_dir, {**PATIENT, "INFERLB_EXT_PROC_FAIR_QUEUE_ORDER": "fifo"}) as d:
        queue_hogs(d, 4)  # from 127.0.0.1
        d.send("other client", sentences(PARAGRAPH_INPUTS, HOG_WORDS), address="127.0.0.2")
        wait_for(lambda: d.queued() == 4, 60, "the other client's paragraph to wait", d.procs)
        d.send("same client", sentences(PARAGRAPH_INPUTS, HOG_WORDS))
        d.join()
        assert all(r.status_code == 200 for r in d.answers.values()), d.answers
        order = d.done
        assert order.index("other client") == order.index("hog0") + 1, order  # its own flow's head: next
        assert order.index("same client") == len(order) - 1, order  # first in, first out within its flow
        # The metric names the tenant, never a client's address.
        depth = [labels for (name, labels) in d.ext_proc.metrics() if name == "inferlb_ext_proc_fair_queue_depth"]
        assert all(dict(labels)["tenant"] == "anonymous" for labels in depth), depth


def test_a_request_that_cannot_get_its_turn_in_time_is_refused_at_once(tmp_path: Path, data_dir: Path) -> None:
    with door(tmp_path, data_dir, {"INFERLB_EXT_PROC_FAIR_QUEUE_MAX_WAIT_S": "0.5"}) as d:
        hold_the_worker(d)  # seconds of work in flight: past half a second's wait whatever comes next
        for i in range(1, 4):
            d.send(f"hog{i}", sentences(HOG_INPUTS, HOG_WORDS))
        d.join()
        assert d.answers["hog0"].status_code == 200
        assert all(r.status_code in (200, 429) for r in d.answers.values()), d.answers
        # Refused at once: the message says the predicted turn, Retry-After comes from it.
        for name in ("hog1", "hog2", "hog3"):
            response = d.answers[name]
            assert response.status_code == 429, (name, response.text)
            assert response.json()["error"]["code"] == "overloaded" and "would come in about" in response.text
            assert int(response.headers["retry-after"]) >= 1
        metrics = d.ext_proc.metrics()
        assert sample(metrics, "inferlb_ext_proc_fair_queue_refusals_total", reason="predicted_wait") == 3
        assert sample(metrics, "inferlb_ext_proc_fair_queue_wait_seconds_count", how="timed_out") in (None, 0)
