"""Real ``POST /v1/embeddings`` bodies whose input has an exact token count.

The bench sends text, not token arrays, so that ext_proc and the workers do
their real work (tokenising with the model's own tokenizer). Each text is
built from common lowercase English words that are each exactly one WordPiece
token of the all-MiniLM-L6-v2 vocabulary, separated by single spaces: ``n``
tokens (counting [CLS] and [SEP], as the worker and ext_proc count them) is
``n - 2`` words. ``tests/test_bench_trace.py`` checks this against the real
tokenizer. Pure: no tokenizer is loaded here, the bench stays light.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import orjson

MODEL = "all-MiniLM-L6-v2"
SPECIAL_TOKENS = 2  # [CLS] and [SEP]
MAX_TOKENS = 256  # the model's limit, special tokens included
VARIANTS = 16  # distinct texts per token count: requests differ without a body per request

# Each is one token of the bert-base-uncased vocabulary that all-MiniLM-L6-v2 uses.
WORDS = tuple("""
the of and to in is was for on that with as by at from his her it an are were be this which or had not but have
has its they their one all been new also first two after more can who when there other into time some only would
over three most such these than years many may where then out about both between up during year city team world
made used under him well later while part each like through what before number since however state being known
united people same you back because game system them even much area four high until school called including due
season make work long still any life own way family public national group small large early just very last best
good great right old real next order place point case week home open water power line side end market level body
book house money night story fact month lot study job word business issue kind head far black white little light
""".split())


def text_with_tokens(tokens: int, variant: int = 0) -> str:
    """A text that tokenises to exactly ``tokens`` tokens, [CLS] and [SEP] included.

    ``variant`` picks one of many fixed word orders; the same (tokens, variant)
    always gives the same text.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not SPECIAL_TOKENS < tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be an integer in [{SPECIAL_TOKENS + 1}, {MAX_TOKENS}] "
                         f"(it counts [CLS] and [SEP]), got {tokens!r}")
    rng = random.Random(tokens * 1_000_003 + variant)
    return " ".join(rng.choices(WORDS, k=tokens - SPECIAL_TOKENS))


def embeddings_body(tokens: int, variant: int = 0, *, inputs: int = 1, model: str = MODEL) -> bytes:
    """An OpenAI embeddings request body: ``input`` is one text, or a list of ``inputs`` texts of ``tokens`` each."""
    if inputs < 1:
        raise ValueError(f"inputs must be >= 1, got {inputs}")
    if inputs == 1:
        payload: str | list[str] = text_with_tokens(tokens, variant)
    else:
        payload = [text_with_tokens(tokens, variant * inputs + i) for i in range(inputs)]
    return orjson.dumps({"model": model, "input": payload})


def bodies_for(tokens: Sequence[int], *, inputs: int = 1, model: str = MODEL,
               repeat_of: Sequence[int] | None = None, salt: int = 0) -> list[bytes]:
    """Pre-encoded bodies for a trace's token counts (``Trace.tokens``), in the same order.

    Without repeats (``repeat_of`` None or all -1: ``Trace.repeat_of``), request ``i`` gets variant
    ``i % VARIANTS`` of its length; equal bodies are shared objects, so a long trace costs memory per
    distinct body only. With repeats, a repeat is its source's very body and every fresh request gets
    a variant of its own, so only the trace's deliberate repeats are identical (what a cache may hit);
    ``salt`` (0 .. 2**20) gives another trace's fresh texts, none equal to this one's (for traces under
    a million requests: the variants are ``salt * 2**32 + ...``, far apart in the text's seed). A salt
    asks for texts of their own even without repeats (a cache bench at 0% repeats must not hit).
    """
    if repeat_of is not None and (salt or any(int(r) >= 0 for r in repeat_of)):
        if not 0 <= salt < 2**20:
            raise ValueError(f"salt must be in [0, 2**20), got {salt!r}")
        return _bodies_with_repeats(tokens, repeat_of, inputs=inputs, model=model, first=(salt << 32) + VARIANTS)
    cache: dict[tuple[int, int], bytes] = {}
    out = []
    for i, n in enumerate(tokens):
        key = (int(n), i % VARIANTS)
        body = cache.get(key)
        if body is None:
            body = cache[key] = embeddings_body(key[0], key[1], inputs=inputs, model=model)
        out.append(body)
    return out


def _bodies_with_repeats(tokens: Sequence[int], repeat_of: Sequence[int], *, inputs: int, model: str,
                         first: int) -> list[bytes]:
    if len(repeat_of) != len(tokens):
        raise ValueError(f"repeat_of has {len(repeat_of)} entries for {len(tokens)} requests")
    out: list[bytes] = []
    fresh = 0
    for i, (n, source) in enumerate(zip(tokens, repeat_of)):
        source = int(source)
        if source >= 0:
            if source >= i:
                raise ValueError(f"request {i} repeats request {source}, which is not an earlier one")
            out.append(out[source])
            continue
        # variants past the shared ones: a fresh text differs from every other of its length
        out.append(embeddings_body(int(n), first + fresh, inputs=inputs, model=model))
        fresh += 1
    return out


# Prose the worker and ext_proc benches cut their texts from (real sentences, varied tokens).
CORPUS = (
    "Load balancers for small models on CPUs must weigh each request by its size, because a request of "
    "two hundred tokens costs many times one of ten. Envoy proxies the bytes while a control plane pushes "
    "weights computed from telemetry, and an external processor picks the endpoint that will finish first. "
    "Embedding models turn sentences into vectors; classifiers label them; small language models answer. "
    "Machines differ in speed, noisy neighbours steal cycles, and queues build where nobody looks. "
)
