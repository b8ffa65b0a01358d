"""ext_proc's per-request core without servers: token counting, cost model, outstanding work, policies, picker.

The token counts are checked against the worker's own tokenizer set-up and
counting rule (the test may import both services; the services may not
import each other).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence

import orjson
import pytest

from ext_proc.pick.cost import CostModel, CostParams, parse_orca, parse_server_timing, service_seconds
from ext_proc.model import Candidate, Decision, EndpointView, RequestView
from ext_proc.pick.outstanding import Outstanding, OutstandingLoad
from ext_proc.pick.policies import InOrder, Rotate
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from inferlb_runtime.pick_chain import PRESETS, LeastCompletionTimeParams, chain_spec
from ext_proc.tokens import TokenCounter, packaged_tokenizer_path

MAX_TOKENS = 256


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package(max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def worker_tokenizer():  # type: ignore[no-untyped-def]
    """The worker's tokenizer, set up by the worker's own code."""
    from workers.model_files import find_packaged_model
    from workers.tokenization import load_tokenizer

    path = find_packaged_model().tokenizer
    assert path == packaged_tokenizer_path()
    return load_tokenizer(path, MAX_TOKENS)


def worker_usage(tokenizer, body: bytes) -> int:  # type: ignore[no-untyped-def]
    """``usage.prompt_tokens`` exactly as workers/service.py computes it for a valid body."""
    from workers.protocol import parse_embeddings_request
    from workers.tokenization import encode_texts

    request = parse_embeddings_request(body, max_inputs=2048, vocab_size=tokenizer.get_vocab_size())
    if request.token_ids is not None:
        return sum(len(ids[:MAX_TOKENS]) for ids in request.token_ids)
    return sum(len(ids) for ids in encode_texts(tokenizer, list(request.texts or ())))


def body(inp: object, **extra: object) -> bytes:
    return orjson.dumps({"input": inp, **extra})


def endpoint(i: int | str, *, weight: int = 100, healthy: bool = True, draining: bool = False,
             telemetry: Mapping[str, float] | None = None) -> EndpointView:
    port = 8100 + i if isinstance(i, int) else 8100
    host = f"10.0.{i // 250}.{i % 250}" if isinstance(i, int) else str(i)
    return EndpointView(id=f"{host}:{port}", address=host, port=port, weight=weight, healthy=healthy,
                        draining=draining, telemetry=telemetry or {})


def view(tokens: int) -> RequestView:
    return RequestView(tokens=tokens, estimated=False, model=None, inputs=1)


def cand(e: EndpointView, cost: float = 0.01, outstanding_s: float = 0.0, requests: int = 0,
         tokens: int = 0) -> Candidate:
    return Candidate(e, cost, outstanding_s, requests, tokens)


class CountingCost:
    """A cost model that counts predictions (to check a decision is O(d))."""

    def __init__(self, inner: CostModel | None = None) -> None:
        self.inner = inner or CostModel()
        self.calls: list[str] = []

    def predict(self, endpoint_id: str, tokens: int, telemetry: Mapping[str, float] | None = None,
                model: str | None = None) -> float:
        self.calls.append(endpoint_id)
        return self.inner.predict(endpoint_id, tokens, telemetry, model)


# --- token counting --------------------------------------------------------------------------------


def test_reference_texts_count_like_the_worker(counter: TokenCounter, reference: dict) -> None:
    items = reference["items"]
    for item in items:
        got = counter.count(body(item["text"]), {})
        assert (got.tokens, got.estimated, got.inputs) == (item["tokens_with_special"], False, 1), item["text"][:40]
    everything = counter.count(body([i["text"] for i in items], model="all-MiniLM-L6-v2"))
    assert everything.tokens == sum(i["tokens_with_special"] for i in items)
    assert everything.inputs == len(items) and everything.model == "all-MiniLM-L6-v2"


LONG_EN = " ".join(["The quick brown fox jumps over the lazy dog, then naps."] * 80)
TEXTS = [
    "", " ", "a", "Hello, world!", "naïve café — 東京 🚀 emojis & accents", "ÀÉÎÕÜ çñ ß ǅ ΣΑΣ ς",
    "東京都は日本の首都です。" * 40, "e\u0301" * 300, "x" * 5000, "antidisestablishmentarianism " * 120,
    "\x01\x02 \x1c\x1d words \u200b\ufffd tab\there\nnewline", "1234567890 " * 400, LONG_EN,
    "word " * 253, "word " * 254, "word " * 255, ("long-text " * 10 + "\n") * 300, "!!!" * 2000,
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_text_counts_equal_the_worker(  # type: ignore[no-untyped-def]
        counter: TokenCounter, worker_tokenizer, text: str) -> None:
    raw = body(text)
    assert counter.count(raw).tokens == worker_usage(worker_tokenizer, raw)


def test_lists_and_token_arrays_count_like_the_worker(  # type: ignore[no-untyped-def]
        counter: TokenCounter, worker_tokenizer) -> None:
    cases = [
        TEXTS,
        ["one", "two two", ""],
        [101, 7592, 102],
        [[101, 7592, 102], [101, 2088, 2088, 102]],
        list(range(1000, 1300)),  # one array over 256: cut
        [list(range(1000, 1300)), [101, 102], list(range(5, 261))],
        [0],
    ]
    for inp in cases:
        raw = body(inp, model="sentence-transformers/all-MiniLM-L6-v2")
        got = counter.count(raw)
        assert not got.estimated
        assert got.tokens == worker_usage(worker_tokenizer, raw), str(inp)[:60]
        assert got.inputs == (1 if isinstance(inp[0], int) else len(inp))
    # token arrays are counted by length: no [CLS]/[SEP] added
    assert counter.count(body([7592, 2088])).tokens == 2
    assert counter.count(body([list(range(300))] * 3)).tokens == 3 * MAX_TOKENS


def test_model_omitted_or_alias_is_counted_unknown_is_estimated(counter: TokenCounter) -> None:
    assert not counter.count(body("hi")).estimated
    assert not counter.count(body("hi", model="sentence-transformers/all-MiniLM-L6-v2")).estimated
    unknown = counter.count(body("hi " * 100, model="gpt-4"), {"x": "1"})
    assert unknown.estimated and unknown.model == "gpt-4" and unknown.headers == {"x": "1"}
    assert unknown.tokens == len(body("hi " * 100, model="gpt-4")) // 4
    custom = TokenCounter(packaged_tokenizer_path(), models={"minilm"})
    assert not custom.count(body("hi", model="minilm")).estimated
    assert custom.count(body("hi", model="all-MiniLM-L6-v2")).estimated


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"\xff\xfe", b"[1,2]", b"null", b'"input"', b"{}", b'{"input": null}', b'{"input": []}',
    b'{"input": 5}', b'{"input": ["a", 1]}', b'{"input": [[1], 2]}', b'{"input": [[]]}', b'{"input": [true]}',
    b'{"input": [{"a": 1}]}', b'{"input": "x", "model": 7}', b'{"input": "x"' + b" " * 10_000,
])
def test_bodies_not_understood_get_a_byte_estimate(counter: TokenCounter, raw: bytes) -> None:
    got = counter.count(raw, {})
    assert got.estimated and got.tokens >= 1 and got.tokens == max(1, len(raw) // 4)


def test_long_text_prefix_shortcut_is_exact(worker_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The prefix shortcuts (ASCII word bound, boundary-cut prefix) never change the capped count.

    A small cap and a tiny prefix make every text "long", so thousands of random
    texts over an adversarial alphabet (combining accents, CJK, control and
    zero-width characters, final sigma, punctuation) hit every cut position.
    """
    from tokenizers import Tokenizer

    cap = 12
    plain = Tokenizer.from_file(str(packaged_tokenizer_path()))
    plain.no_padding()
    plain.enable_truncation(max_length=cap)
    small = TokenCounter(packaged_tokenizer_path(), max_tokens=cap, prefix_chars=6)
    alphabet = ["a", "b", "ab", "the ", " ", "  ", "\n", "\t", ".", ",", "-", "'", "é", "e\u0301", "\u0301", "東",
                "京", "ς", "Σ", "\x01", "\x1c", "\u200b", "\ufffd", "\u00a0", "🚀", "un", "believ", "able", "x" * 30]
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert small.count_text(text) == len(plain.encode(text).ids), repr(text)
    # and at the real size, texts on both sides of the cap
    full = TokenCounter.from_package()
    for words in (100, 250, 253, 254, 255, 600, 3000):
        for sep in (" ", "\n", "東"):
            text = sep.join(rng.choice(["cat", "sat", "mat", "é", "!", "zebra", "ünïcödé"]) for _ in range(words))
            assert full.count_text(text) == len(worker_tokenizer.encode(text).ids)


def test_needs_thread_for_large_bodies(counter: TokenCounter) -> None:
    assert not counter.needs_thread(body("short"))
    assert counter.needs_thread(body("x " * 20_000))


# --- cost model ------------------------------------------------------------------------------------


def test_prior_for_unknown_endpoints() -> None:
    cost = CostModel()
    assert cost.predict("new:1", 16) == pytest.approx(0.004, rel=0.01)
    assert cost.predict("new:1", 256) == pytest.approx(0.064, rel=0.01)
    telemetry = {"batch_cost_per_token_s": 0.0001, "batch_cost_fixed_s": 0.002}
    assert cost.predict("new:2", 100, telemetry) == pytest.approx(0.012, rel=0.01)
    assert cost.predict("new:3", 100, {"batch_cost_per_token_s": 0.0}) == pytest.approx(0.025, rel=0.01)
    assert math.isnan(cost.mape()) and math.isnan(cost.mape("new:1"))


def _train(cost: CostModel, endpoint_id: str, a: float, b: float, n: int, rng: random.Random,
           noise: float = 0.05, c: float = 0.0) -> None:
    for _ in range(n):
        tokens = rng.randint(2, 256)
        cost.observe(endpoint_id, tokens, (a + b * tokens + c * tokens * tokens) * (1 + rng.uniform(-noise, noise)))


def test_cost_model_converges_and_mape_falls() -> None:
    rng = random.Random(1)
    cost = CostModel()
    a, b = 0.003, 0.0006  # 2.4x slower per token than the prior, with a fixed cost
    _train(cost, "e", a, b, 20, rng)
    early = cost.mape("e")
    _train(cost, "e", a, b, 400, rng)
    fa, fb = cost.coefficients("e")
    assert fa == pytest.approx(a, rel=0.25) and fb == pytest.approx(b, rel=0.05)
    for n in (8, 64, 256):
        assert cost.predict("e", n) == pytest.approx(a + b * n, rel=0.06)
    assert cost.mape("e") < 0.06 < early
    assert cost.mape() == pytest.approx(cost.mape("e"))
    assert cost.observed("e") == 420 and cost.observations == 420


def test_cost_model_adapts_when_speed_changes_and_survives_outliers() -> None:
    rng = random.Random(2)
    cost = CostModel()
    _train(cost, "e", 0.001, 0.0002, 300, rng)
    cost.observe("e", 10, 30.0)  # a GC pause: clipped, not learnt as is
    assert cost.predict("e", 128) < 2 * (0.001 + 0.0002 * 128)
    _train(cost, "e", 0.002, 0.0005, 250, rng)  # the machine got 2.5x slower
    assert cost.predict("e", 128) == pytest.approx(0.002 + 0.0005 * 128, rel=0.08)
    assert cost.predict("other", 128) == pytest.approx(0.032, rel=0.01)  # others keep the prior


def test_cost_model_little_variety_keeps_a_sane_slope() -> None:
    cost = CostModel()
    for _ in range(2000):
        cost.observe("e", 16, 0.004)  # always the same size: no wind-up, slope stays near the prior
    assert cost.predict("e", 16) == pytest.approx(0.004, rel=0.02)
    assert 0.02 < cost.predict("e", 256) < 0.12


def test_cost_model_quadratic_and_forgetting_endpoints() -> None:
    rng = random.Random(3)
    cost = CostModel(CostParams(quadratic=True, decay=0.995))
    _train(cost, "e", 0.001, 0.0001, 1000, rng, noise=0.01, c=1e-6)
    for n in (16, 128, 256):
        assert cost.predict("e", n) == pytest.approx(0.001 + 0.0001 * n + 1e-6 * n * n, rel=0.05)
    cost.retain({"f"})
    assert cost.observed("e") == 0
    with pytest.raises(ValueError):
        CostParams(decay=0)


def test_observe_ignores_nonsense_and_uses_given_prediction_for_error() -> None:
    cost = CostModel()
    for bad in (0.0, -1.0, math.nan, math.inf):
        cost.observe("e", 10, bad)
    assert cost.observations == 0
    cost.observe("e", 100, 0.010, predicted_s=0.020)
    assert cost.mape("e") == pytest.approx(1.0)


def test_parse_server_timing_and_orca_from_the_worker() -> None:
    timing = parse_server_timing("queue;dur=1.500, compute;dur=5.250, total;dur=7.000")
    assert timing == pytest.approx({"queue": 0.0015, "compute": 0.00525, "total": 0.007})
    assert service_seconds(timing) == pytest.approx(0.00525)
    assert service_seconds(parse_server_timing("total;dur=7.000")) == pytest.approx(0.007)
    assert service_seconds(parse_server_timing("queue;dur=2, total;dur=7")) == pytest.approx(0.005)
    assert service_seconds({}) is None
    assert parse_server_timing('cache;desc="hit", db;dur=abc, x;dur="2.5", ;dur=1, ,') == {"x": 0.0025}
    assert parse_server_timing("") == {}
    orca = parse_orca("TEXT cpu_utilization=0.5000, rps_fractional=1.000, named_metrics.queue=3, "
                      "named_metrics.inflight=2")
    assert orca == {"cpu_utilization": 0.5, "rps_fractional": 1.0, "named_metrics.queue": 3.0,
                    "named_metrics.inflight": 2.0}
    assert parse_orca('JSON {"cpu_utilization": 0.25, "named_metrics": {"queue": 4}}') == {
        "cpu_utilization": 0.25, "named_metrics.queue": 4.0}
    for junk in ("", "BIN AAAA", "TEXT a=b, =1, c", "JSON {", "JSON [1]", "garbage"):
        assert parse_orca(junk) == {}


# --- outstanding work ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_outstanding_begin_finish_is_idempotent_and_leak_free() -> None:
    out = Outstanding()
    out.begin("r1", "a", 10, 0.01)
    out.begin("r2", "a", 20, 0.02)
    out.begin("r3", "b", 5, 0.005)
    assert out.of("a") == OutstandingLoad(2, 30, pytest.approx(0.03))
    assert out.total() == OutstandingLoad(3, 35, pytest.approx(0.035))
    assert out.finish("r1") is True
    assert out.finish("r1") is False  # a stream ending twice releases once
    assert out.finish("never-begun") is False
    assert out.of("a") == OutstandingLoad(1, 20, pytest.approx(0.02))
    out.begin("r3", "c", 7, 0.007)  # the same key again moves, never doubles
    assert out.of("b") == OutstandingLoad() and out.of("c").requests == 1
    rng = random.Random(0)
    keys = [f"k{i}" for i in range(2000)]
    for k in keys:
        out.begin(k, rng.choice("abc"), rng.randint(1, 256), rng.random() / 10)
    rng.shuffle(keys)
    for k in keys + keys[:50]:
        out.finish(k)
    out.finish("r2")
    out.finish("r3")
    assert len(out) == 0 and out.snapshot() == {} and out.total() == OutstandingLoad()
    assert out.of("a").seconds == 0.0  # no float drift left behind
    assert out.leaked == 0


def test_outstanding_safety_net_drops_and_counts_old_entries() -> None:
    clock = FakeClock()
    out = Outstanding(max_age_s=60, sweep_interval_s=1, clock=clock)
    out.begin("old", "a", 10, 0.01)
    clock.now += 30
    out.begin("young", "a", 10, 0.01)
    clock.now += 40  # "old" is 70 s old, "young" 40 s
    out.begin("new", "b", 1, 0.001)  # begin sweeps at most once per interval
    assert "old" not in out and "young" in out and out.leaked == 1
    assert out.of("a").requests == 1
    assert out.finish("old") is False
    clock.now += 100
    assert out.sweep() == 2 and out.total() == OutstandingLoad() and out.leaked == 3


# --- policies --------------------------------------------------------------------------------------


class Picker:
    """The router as these tests drive it: a decision books nothing (the tests begin and finish work on
    ``outstanding`` themselves), so each decision is released at once."""

    def __init__(self, policy: str, params: dict | None = None, cost: object | None = None,
                 clock: object | None = None) -> None:
        options = {"clock": clock} if clock is not None else {}
        self.router = Router(PluginRegistry(), policy, params, cost=cost or CostModel(),  # type: ignore[arg-type]
                             outstanding=Outstanding(**options), **options)  # type: ignore[arg-type]
        self.outstanding = self.router.outstanding
        self._keys = iter(range(-1, -10**9, -1))

    def decide(self, request: RequestView, fleet: Sequence[EndpointView]) -> Decision | None:
        key = next(self._keys)
        decision = self.router.decide(key, request, fleet)
        self.router.release(key)
        return decision  # type: ignore[return-value]

    def set_policy(self, name: str, params: dict | None = None) -> None:
        self.router.set_policy(name, params)

    def set_partition(self, index: int, count: int) -> None:
        self.router.set_partition(index, count)

    def note_load(self, endpoint_id: str, orca: Mapping[str, float]) -> None:
        self.router.learn(endpoint_id, 0, orca=orca)

    @property
    def partitioned(self) -> bool:
        return self.router.partition.partitioned

    @property
    def replica_factor(self) -> float:
        return self.router.costing.replica_factor


def make_picker(policy: str, params: dict | None = None, cost: object | None = None, **kwargs: object) -> Picker:
    return Picker(policy, params, cost, **kwargs)  # type: ignore[arg-type]


LCT = "least_completion_time"


def test_lct_sends_a_request_away_from_a_long_queue() -> None:
    a, b = endpoint(1), endpoint(2)
    picker = make_picker(LCT, {"seed": 1})
    for i in range(5):
        picker.outstanding.begin(f"long{i}", a.id, 256, 0.064)
    fleet = (a, b)
    for _ in range(20):
        decision = picker.decide(view(16), fleet)
        assert decision is not None and decision.ranked == (b.id, a.id)
        assert decision.predicted_s == pytest.approx(0.004, rel=0.01)
        assert decision.completion_s == pytest.approx(0.004, rel=0.01) and decision.policy == "least_completion_time"


def test_lct_long_and_short_sent_together_land_apart() -> None:
    a, b = endpoint(1), endpoint(2)
    picker = make_picker("least_completion_time", {"seed": 3})
    long = picker.decide(view(256), (a, b))
    assert long is not None
    picker.outstanding.begin("long", long.primary, 256, long.predicted_s)
    short = picker.decide(view(12), (a, b))
    assert short is not None and short.primary != long.primary


def test_lct_prefers_the_faster_endpoint_for_a_long_request() -> None:
    fast, slow = endpoint(1), endpoint(2)
    cost = CostModel()
    rng = random.Random(4)
    _train(cost, fast.id, 0.001, 0.0001, 200, rng)
    _train(cost, slow.id, 0.001, 0.0004, 200, rng)
    picker = make_picker(LCT, {"seed": 1}, cost)
    # the slow one has a short queue (10 ms), but a 256-token request costs 104 ms there and 27 ms on the fast one
    picker.outstanding.begin("q", fast.id, 100, 0.03)
    decision = picker.decide(view(256), (fast, slow))
    assert decision is not None and decision.primary == fast.id
    # ... while a tiny request is better off on the idle slow one
    tiny = picker.decide(view(4), (fast, slow))
    assert tiny is not None and tiny.primary == slow.id


def test_lct_defaults_leave_weights_out_of_sampling_and_score() -> None:
    params = LeastCompletionTimeParams()
    assert (params.weight_exponent, params.sample_weighted, params.d) == (0.0, False, 4)


def test_lct_respects_weights_as_capacity() -> None:
    big, small = endpoint(1, weight=300), endpoint(2, weight=100)
    picker = make_picker(LCT, {"seed": 5, "weight_exponent": 1})
    picks: Counter[str] = Counter()
    for i in range(400):
        d = picker.decide(view(64), (big, small))
        assert d is not None
        picks[d.primary] += 1
        picker.outstanding.begin(i, d.primary, 64, d.predicted_s)  # never finished: pure capacity split
    assert 2.6 < picks[big.id] / picks[small.id] < 3.4
    # weight_exponent 0 ignores weights: an even split
    even = make_picker(LCT, {"seed": 5, "weight_exponent": 0})
    picks.clear()
    for i in range(400):
        d = even.decide(view(64), (big, small))
        assert d is not None
        picks[d.primary] += 1
        even.outstanding.begin(i, d.primary, 64, d.predicted_s)
    assert picks[big.id] == picks[small.id] == 200


def test_lct_ties_break_at_random() -> None:
    fleet = tuple(endpoint(i) for i in range(3))
    picker = make_picker(LCT, {"seed": 9})
    firsts = Counter(picker.decide(view(16), fleet).primary for _ in range(300))  # type: ignore[union-attr]
    assert set(firsts) == {e.id for e in fleet} and min(firsts.values()) > 60


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_no_policy_ever_picks_draining_or_unhealthy(name: str) -> None:
    fleet = tuple(endpoint(i, draining=i % 3 == 1, healthy=i % 3 != 2) for i in range(30))
    ok = {e.id for e in fleet if e.routable}
    picker = make_picker(name, {})
    for i in range(300):
        d = picker.decide(view(32), fleet)
        assert d is not None and set(d.ranked) <= ok
        assert len(set(d.ranked)) == len(d.ranked) and 1 <= len(d.ranked) <= 3
        picker.outstanding.begin(i, d.primary, 32, d.predicted_s)
    # the unhealthy endpoint is idle and would win on load alone: still never picked
    lone = (endpoint(1, healthy=False), endpoint(2, weight=1))
    for i in range(20):
        d = picker.decide(view(32), lone)
        assert d is not None and d.ranked == (lone[1].id,)


def test_lct_power_of_d_costs_only_d_candidates_on_a_large_fleet() -> None:
    fleet = tuple(endpoint(i) for i in range(2000))
    cost = CountingCost()
    picker = make_picker(LCT, {"d": 4, "seed": 11}, cost)
    primaries: set[str] = set()
    for i in range(500):
        cost.calls.clear()
        d = picker.decide(view(32), fleet)
        assert d is not None and d.evaluated == 4
        assert len(cost.calls) == 4 and len(set(cost.calls)) == 4  # O(d): four distinct endpoints costed
        assert d.primary in cost.calls and len(d.ranked) == 3 and len(set(d.ranked)) == 3
        primaries.add(d.primary)
    assert len(primaries) > 300  # sampling spreads over the fleet


def test_power_of_d_samples_by_weight() -> None:
    fleet = tuple(endpoint(i, weight=1000 if i < 10 else 1) for i in range(1000))
    heavy = {e.id for e in fleet[:10]}
    cost = CountingCost()
    picker = make_picker(LCT, {"d": 2, "seed": 2, "sample_weighted": True}, cost)
    for _ in range(200):
        picker.decide(view(32), fleet)
    share = sum(c in heavy for c in cost.calls) / len(cost.calls)
    assert share > 0.85  # 10 x 1000 of a total weight of 10,990


def test_round_robin_cycles() -> None:
    fleet = tuple(endpoint(i) for i in range(3))
    ids = [e.id for e in fleet]
    picker = make_picker("round_robin", {})
    got = [picker.decide(view(1), fleet).ranked for _ in range(6)]  # type: ignore[union-attr]
    assert got == [tuple(ids[(s + k) % 3] for k in range(3)) for s in (0, 1, 2, 0, 1, 2)]
    rr, first = Rotate(), InOrder()  # round robin's two plugins
    cands = [cand(e) for e in fleet]
    assert [first.pick(view(1), [cands[ids.index(e.id)] for e in rr.filter(view(1), fleet)], [])[0]
            for _ in range(4)] == [ids[0], ids[1], ids[2], ids[0]]
    one = make_picker("round_robin", {"fallbacks": 0})
    assert one.decide(view(1), fleet).ranked == (ids[0],)  # type: ignore[union-attr]


def test_least_outstanding() -> None:
    fleet = tuple(endpoint(i) for i in range(3))
    picker = make_picker("least_outstanding", {"seed": 1})
    picker.outstanding.begin("x", fleet[0].id, 1, 1.0)
    picker.outstanding.begin("y", fleet[0].id, 1, 1.0)
    picker.outstanding.begin("z", fleet[1].id, 1000, 9.0)
    d = picker.decide(view(1), fleet)
    assert d is not None and d.ranked == (fleet[2].id, fleet[1].id, fleet[0].id)
    picker.outstanding.begin("w", fleet[2].id, 1, 1.0)  # now 1 and 2 tie on one request each
    firsts = Counter(picker.decide(view(1), fleet).primary for _ in range(200))  # type: ignore[union-attr]
    assert set(firsts) == {fleet[1].id, fleet[2].id}


def test_p2c_tokens() -> None:
    a, b = endpoint(1), endpoint(2)
    picker = make_picker("p2c_tokens")
    picker.outstanding.begin("x", a.id, 500, 0.001)
    picker.outstanding.begin("y", b.id, 20, 0.001)
    picker.outstanding.begin("z", b.id, 20, 0.001)  # more requests, fewer tokens
    d = picker.decide(view(10), (a, b))
    assert d is not None and d.ranked == (b.id, a.id)
    fleet = tuple(endpoint(i) for i in range(100))
    cost = CountingCost()
    big = make_picker("p2c_tokens", {"seed": 4}, cost)
    for _ in range(50):
        cost.calls.clear()
        d = big.decide(view(10), fleet)
        assert d is not None and len(d.ranked) == 2 and len(cost.calls) == 2


def test_registry_and_param_errors() -> None:
    assert set(PRESETS) == {"least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"}
    registry = PluginRegistry()
    for name in PRESETS:
        assert registry.build(name).policy == name
    lct = chain_spec("least_completion_time", {"d": 8.0, "seed": 3.0, "weight_exponent": 1})
    assert (lct.sample.d, lct.sample.seed, lct.scorers[0].params) == (8, 3, {"weight_exponent": 1.0})
    assert PRESETS["least_completion_time"].params() == LeastCompletionTimeParams()
    with pytest.raises(ValueError, match="pick policy .nope. is unknown.*least_completion_time"):
        registry.build("nope")
    bad = [
        ({"d": 0}, "'d' must be >= 1"), ({"d": 2.5}, "'d': expected an integer"), ({"d": "4"}, "integer"),
        ({"d": True}, "integer"), ({"speed": 1}, "unknown param.*speed"), ({"fallbacks": 3}, "fallbacks"),
        ({"weight_exponent": math.nan}, "number"), ({"sample_weighted": 1}, "true or false"),
    ]
    for params, message in bad:
        with pytest.raises(ValueError, match=message):
            registry.build("least_completion_time", params)
    with pytest.raises(ValueError, match="params must be an object"):
        registry.build("round_robin", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'round_robin': unknown param"):
        registry.build("round_robin", {"seed": 1})


# --- picker ----------------------------------------------------------------------------------------


def test_picker_returns_none_without_a_routable_endpoint() -> None:
    picker = make_picker("least_completion_time")
    assert picker.decide(view(10), ()) is None
    assert picker.decide(view(10), (endpoint(1, draining=True), endpoint(2, healthy=False))) is None


def test_picker_validates_the_ranking_and_switches_policy() -> None:
    """A user filter that makes up endpoints is left out of that decision (the rest of the chain decides);
    switching policy swaps the whole chain."""
    class Liar:
        name = "liar"

        def __init__(self, answer: Sequence[object]) -> None:
            self.answer = answer

        def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[object]:
            return self.answer

    from ext_proc.pick.guard import GuardedPlugin

    fleet = (endpoint(1), endpoint(2), endpoint(3, draining=True))
    ids = [e.id for e in fleet]
    picker = make_picker(LCT, {"seed": 1})
    chain = picker.router.chain
    liar = GuardedPlugin(Liar(["made:up", fleet[2], fleet[1]]), "filter")
    chain.filters = (*chain.filters, liar)
    d = picker.decide(view(10), fleet)
    assert d is not None and set(d.ranked) == {ids[0], ids[1]} and d.evaluated == 2
    assert liar.failures == {"unknown_endpoint": 1}
    picker.set_policy("round_robin")
    switched = picker.decide(view(10), fleet)
    assert picker.router.policy == "round_robin" and switched is not None and switched.policy == "round_robin"
    assert switched == Decision((ids[0], ids[1]), pytest.approx(0.0025), "round_robin", pytest.approx(0.0025), 2)


def test_picker_counts_foreign_work_from_telemetry_and_orca() -> None:
    clock = FakeClock()
    a = endpoint(1, telemetry={"inflight": 4})  # the worker reports 4 requests, 1 of them ours
    b = endpoint(2)
    picker = make_picker(LCT, {"seed": 1}, clock=clock)
    picker.outstanding.begin("ours", a.id, 32, 0.008)
    d = picker.decide(view(32), (a, b))
    assert d is not None and d.ranked[1] == a.id
    cands = {c.id: c for c in _candidates(picker, view(32), (a, b))}
    assert cands[a.id].outstanding_s == pytest.approx(0.008 + 3 * 0.008, rel=0.1)
    # a response to "answered" (ours, still counted, as server.py notes before releasing): 2 in flight there,
    # both ours, so no foreign work; the ORCA report is younger than load_ttl_s, so it wins
    picker.outstanding.begin("answered", a.id, 32, 0.008)
    clock.now += 0.1
    picker.note_load(a.id, parse_orca("TEXT named_metrics.inflight=2"))
    picker.outstanding.finish("answered")
    assert {c.id: c for c in _candidates(picker, view(32), (a, b))}[a.id].outstanding_s == pytest.approx(0.008)
    clock.now += 0.1
    # a newer EDS view: its gauge was scraped before it arrived, so the report, taken as the worker
    # answered, still wins while it is younger than load_ttl_s ...
    fresh_eds = (endpoint(1, telemetry={"inflight": 4}), b)
    assert {c.id: c for c in _candidates(picker, view(32), fresh_eds)}[a.id].outstanding_s == pytest.approx(0.008)
    # ... and once it is older, the view's gauge counts again
    clock.now += picker.router.costing.load_ttl_s
    assert {c.id: c for c in _candidates(picker, view(32), fresh_eds)}[a.id].outstanding_s > 0.02


def test_picker_extrapolates_a_load_report_with_what_it_began_since() -> None:
    clock = FakeClock()
    a, b = endpoint(1), endpoint(2)
    picker = make_picker(LCT, {"seed": 1}, clock=clock)
    picker.decide(view(32), (a, b))
    picker.outstanding.begin("answered", a.id, 32, 0.008)
    picker.note_load(a.id, parse_orca("TEXT named_metrics.inflight=4"))  # 3 foreign after the answered one
    picker.outstanding.finish("answered")
    picker.outstanding.begin("later", a.id, 32, 0.008)  # began after the report: not in it, yet counted
    cands = {c.id: c for c in _candidates(picker, view(32), (a, b))}
    assert cands[a.id].outstanding_s == pytest.approx(0.008 + 3 * 0.008, rel=0.1)


def test_picker_scales_its_own_picks_by_its_share_of_the_fleet_traffic() -> None:
    """With telemetry saying the fleet serves 10x what this ext_proc sends, each request it began since
    the snapshot stands for 10: the other replicas are taken to act alike instead of herding blind."""
    clock = FakeClock()
    fleet = (endpoint(1, telemetry={"inflight": 0, "rps": 50}), endpoint(2, telemetry={"inflight": 0, "rps": 50}))
    picker = make_picker(LCT, {"seed": 1}, clock=clock)
    picker.decide(view(32), fleet)
    for i in range(10):  # 10 decisions/s of our own
        picker.decide(view(32), fleet)
    clock.now += 1.0
    again = tuple(endpoint(i, telemetry={"inflight": 0, "rps": 50}) for i in (1, 2))
    picker.decide(view(32), again)
    assert picker.replica_factor == pytest.approx(100 / 11, rel=0.01)
    picker.outstanding.begin("ours", again[0].id, 32, 0.008)
    cands = {c.id: c for c in _candidates(picker, view(32), again)}
    assert cands[again[0].id].outstanding_s == pytest.approx(0.008 * 100 / 11, rel=0.1)
    assert cands[again[1].id].outstanding_s == 0.0


def _candidates(picker: Picker, request: RequestView, fleet: Sequence[EndpointView]) -> list[Candidate]:
    """What the chain's scorers would see: the fleet's routable endpoints, costed (after a decision has
    taken the view in)."""
    picker.decide(request, fleet)
    return picker.router.costing.candidates(request, [e for e in fleet if e.routable])


# --- partitioning a large fleet among ext_proc replicas ----------------------------------------------


def _partition_ids(fleet: Sequence[EndpointView], index: int, count: int) -> set[str]:
    return set(sorted(e.id for e in fleet)[index::count])


def test_a_replica_picks_only_in_its_partition_of_a_large_fleet() -> None:
    fleet = tuple(endpoint(i) for i in range(64))
    for index in (0, 1):
        picker = make_picker(LCT, {"seed": index})
        picker.set_partition(index, 2)
        picked = set()
        for _ in range(400):
            decision = picker.decide(view(16), fleet)
            assert decision is not None
            picked.update(decision.ranked)
        assert picker.partitioned
        # every partition member gets picked, and nothing else does
        assert picked == _partition_ids(fleet, index, 2)


def test_small_fleets_and_single_replicas_are_never_partitioned() -> None:
    small = tuple(endpoint(i) for i in range(63))  # < 32 per replica for 2 replicas
    picker = make_picker(LCT, {"seed": 5})
    picker.set_partition(1, 2)
    picked = set()
    for _ in range(2000):
        decision = picker.decide(view(16), small)
        assert decision is not None
        picked.add(decision.primary)
    assert not picker.partitioned and picked == {e.id for e in small}
    picker.set_partition(0, 1)
    assert picker.decide(view(16), tuple(endpoint(i) for i in range(100))) and not picker.partitioned


def test_a_partition_with_nothing_routable_falls_back_to_the_whole_fleet() -> None:
    ids = sorted(endpoint(i).id for i in range(64))
    ours = set(ids[1::2])
    fleet = tuple(endpoint(i, draining=endpoint(i).id in ours) for i in range(64))
    picker = make_picker(LCT, {"seed": 2})
    picker.set_partition(1, 2)
    decision = picker.decide(view(16), fleet)
    assert decision is not None and decision.primary not in ours and not picker.partitioned


def test_the_replica_factor_counts_only_the_partitions_traffic() -> None:
    """Only we send to our partition: its rps over ours is ~1, so our picks are not extrapolated tenfold."""
    clock = [0.0]
    fleet = tuple(endpoint(i, telemetry={"rps": 10.0}) for i in range(64))
    picker = Picker(LCT, {"seed": 1}, CostModel(), clock=lambda: clock[0])
    picker.set_partition(0, 2)
    picker.decide(view(16), fleet)
    for _ in range(320):  # 320 decisions in 1 s; our partition (32 endpoints) served 320/s
        picker.decide(view(16), fleet)
    clock[0] = 1.0
    picker.decide(view(16), tuple(endpoint(i, telemetry={"rps": 10.0}) for i in range(64)))
    assert picker.replica_factor == pytest.approx(1.0, abs=0.05)


def test_set_partition_rejects_an_index_outside_the_count() -> None:
    picker = make_picker(LCT)
    for index, count in ((2, 2), (-1, 3), (0, 0)):
        with pytest.raises(ValueError, match="partition index"):
            picker.set_partition(index, count)


def test_request_headers_read_without_a_parse_say_what_the_parsed_mapping_says() -> None:
    """``RequestHeaders.get`` answers pseudo-headers and absent headers without parsing the rest; each
    answer is the one the parsed mapping gives (the last of repeated headers, never a stripped one)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from ext_proc.wire import RequestHeaders

    pairs = [(":method", "POST"), (":path", "/v1/embeddings?x=1"), ("cache-control", "no-cache"),
             ("cache-control", "no-store"), ("x-gateway-destination-endpoint", "10.0.0.1:1"),
             ("x-note", "cache-control: max-age=1")]
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))
    raw = pb.ProcessingRequest(request_headers=message).SerializeToString()
    strip = ["x-gateway-destination-endpoint"]
    names = [":method", ":path", ":authority", "cache-control", "x-gateway-destination-endpoint", "x-note",
             "max-age", "absent", "näme"]
    lazy = [RequestHeaders(message, strip, raw).get(name, "-") for name in names]
    parsed = RequestHeaders(message, strip, raw)
    assert len(parsed) == 4  # parses: every later read is the mapping's
    assert lazy == [parsed.get(name, "-") for name in names] == [
        "POST", "/v1/embeddings?x=1", "-", "no-store", "-", "cache-control: max-age=1", "-", "-", "-"]
    assert [RequestHeaders(message, strip).get(name, "-") for name in names] == lazy  # without the raw bytes
