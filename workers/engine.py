"""One ONNX Runtime session that turns batches of token ids into embeddings.

Blocking on purpose: the worker runs ``embed`` in a thread so the event loop
stays free. Threads default to one intra-op and one inter-op thread, and
spinning is off, because several workers share the machine's cores: two
1-thread workers beat one 2-thread worker, and spinning threads steal the
cores the neighbours need. A graph whose output is not unit length (a
packaged model's plain mean pooling) is normalised here, so every version
answers with unit vectors as OpenAI's embeddings are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from workers.onnx_graph import ATTENTION_MASK, INPUT_IDS, OUTPUT


class Engine:
    """Embeds token-id batches with an embedding model: one built by ``workers.onnx_graph`` (``output`` None),
    or another that takes ``input_ids`` and ``attention_mask`` and gives one pooled vector per row at ``output``."""

    def __init__(
        self,
        model_path: Path,
        *,
        output: str | None = None,
        normalise: bool = False,
        intra_op_threads: int = 1,
        inter_op_threads: int = 1,
        allow_spinning: bool = False,
    ) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = inter_op_threads
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not allow_spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self._session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        meta = self._session.get_modelmeta().custom_metadata_map
        self._output = output or OUTPUT
        self._normalise = normalise
        outputs = {o.name: o for o in self._session.get_outputs()}
        if self._output not in outputs:
            raise ValueError(f"{model_path}: no output {self._output!r} (it has {', '.join(outputs)})")
        self._dimensions = int(outputs[self._output].shape[1])
        # Limits of the embedding tables: ids or lengths beyond them would fail inside ORT.
        self._vocab_size = int(meta["vocab_size"]) if "vocab_size" in meta else None
        self._max_positions = int(meta["max_position_embeddings"]) if "max_position_embeddings" in meta else None

    @property
    def dimensions(self) -> int:
        """Length of each embedding."""
        return self._dimensions

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """Embed each token-id sequence; float32 array of shape (len(batch), dimensions).

        Pads with 0 to the longest item; the attention mask keeps the padding
        from changing any embedding, but it still costs compute, so callers
        should batch items of similar length.
        """
        if not batch:
            return np.empty((0, self._dimensions), dtype=np.float32)
        longest = max(len(item) for item in batch)
        if min(len(item) for item in batch) == 0:
            raise ValueError("every item needs at least one token")
        if self._max_positions is not None and longest > self._max_positions:
            raise ValueError(f"an item has {longest} tokens; the model takes at most {self._max_positions}")
        input_ids = np.zeros((len(batch), longest), dtype=np.int64)
        attention_mask = np.zeros((len(batch), longest), dtype=np.int64)
        for row, item in enumerate(batch):
            input_ids[row, : len(item)] = item
            attention_mask[row, : len(item)] = 1
        if self._vocab_size is not None and (input_ids.min() < 0 or input_ids.max() >= self._vocab_size):
            raise ValueError(f"token ids must be in [0, {self._vocab_size})")
        (embeddings,) = self._session.run([self._output], {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask})
        if self._normalise:
            norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
            embeddings = embeddings / np.maximum(norms, np.finfo(np.float32).tiny)
        return embeddings
