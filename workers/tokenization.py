"""The model's own WordPiece tokenizer, set up the way sentence-transformers uses it.

``tokenizer.json`` as shipped pads and truncates to 128; sentence-transformers
instead truncates at ``max_seq_length`` (256, special tokens included) and
pads per batch. Here padding is off: the engine pads each batch itself, and
token counts (which the balancer routes on) must be the unpadded lengths.
Versions with another limit (paraphrase-MiniLM-L3-v2: 128) share the
vocabulary but need a tokenizer of their own: truncation is a tokenizer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(path: Path, max_tokens: int = 256) -> Tokenizer:
    """Load ``tokenizer.json`` with truncation at ``max_tokens`` (incl. [CLS]/[SEP]) and no padding."""
    return _truncating(Tokenizer.from_file(str(path)), max_tokens)


def truncated_at(tokenizer: Tokenizer, max_tokens: int) -> Tokenizer:
    """A copy of ``tokenizer`` that truncates at ``max_tokens`` (incl. [CLS]/[SEP]); the original is unchanged."""
    return _truncating(Tokenizer.from_str(tokenizer.to_str()), max_tokens)


def _truncating(tokenizer: Tokenizer, max_tokens: int) -> Tokenizer:
    tokenizer.no_padding()
    # max_length counts the special tokens the post-processor adds: 254 pieces + [CLS] + [SEP].
    tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, with special tokens, unpadded."""
    return [encoding.ids for encoding in tokenizer.encode_batch(list(texts))]
