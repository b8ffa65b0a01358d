"""Build the all-MiniLM-L6-v2 forward pass as an ONNX graph from numpy weights.

Why by hand: exporting through torch would make torch (and gigabytes of CUDA)
a set-up dependency. The encoder is small and fixed, so it is spelled out
node by node here with ``onnx.helper``. The node patterns follow what a
PyTorch export of Hugging Face's BertModel produces (MatMul+Add, Div/Erf
GELU, additive mask), so ONNX Runtime's graph fusions recognise them.

The graph ends with sentence-transformers' pooling: the mean of the token
states over ``attention_mask``, then L2 normalisation, so the output is the
finished sentence embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from workers.model_files import BertConfig

OPSET = 17  # LayerNormalization is standard from 17; ORT 1.31 and its tools handle it well.
IR_VERSION = 8  # the IR version that goes with opset 17
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "embedding"
# Added to attention scores of padded keys; exp() of it underflows to exactly 0.
MASK_VALUE = -10000.0


@dataclass
class _GraphBuilder:
    """Collects nodes and initialisers with unique names (lives for one build)."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    _count: int = 0

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def scalar(self, value: float) -> str:
        self._count += 1
        return self.const(f"const_{self._count}", np.array(value, dtype=np.float32))

    def ints(self, values: list[int]) -> str:
        self._count += 1
        return self.const(f"ints_{self._count}", np.array(values, dtype=np.int64))

    def op(self, op_type: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name


def linear_node_name(layer: int, part: str) -> str:
    """Name of a layer's Linear MatMul node (part: q, k, v, attn_out, ffn_in, ffn_out).

    Quantisation refers to nodes by these names to keep a few of them in fp32.
    """
    return f"l{layer}_{part}_matmul"


def _weight_lookup(weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Accept checkpoints saved from BertModel ("embeddings...") or with a "bert." prefix."""
    if "embeddings.word_embeddings.weight" in weights:
        return weights
    prefix = "bert."
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def build_embedding_graph(weights: Mapping[str, np.ndarray], config: BertConfig) -> onnx.ModelProto:
    """Return the ONNX model: (input_ids, attention_mask) -> L2-normalised mean-pooled embedding.

    Both inputs are int64 [batch, sequence]; the output is float32 [batch, hidden].
    Padded positions (attention_mask 0) influence neither attention nor pooling.
    """
    w = _weight_lookup(weights)

    def get(name: str) -> np.ndarray:
        if name not in w:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return np.asarray(w[name], dtype=np.float32)

    g = _GraphBuilder()
    hidden, heads, head_size = config.hidden_size, config.num_heads, config.head_size
    eps = config.layer_norm_eps

    def linear(x: str, prefix: str, layer: int, part: str) -> str:
        # torch Linear stores [out, in]; MatMul wants [in, out].
        weight = g.const(f"{prefix}.weight", get(f"{prefix}.weight").T)
        bias = g.const(f"{prefix}.bias", get(f"{prefix}.bias"))
        product = g.op("MatMul", [x, weight], linear_node_name(layer, part))
        return g.op("Add", [product, bias], f"l{layer}_{part}")

    def layer_norm(x: str, prefix: str, out: str) -> str:
        gamma = g.const(f"{prefix}.weight", get(f"{prefix}.weight"))
        beta = g.const(f"{prefix}.bias", get(f"{prefix}.bias"))
        return g.op("LayerNormalization", [x, gamma, beta], out, axis=-1, epsilon=eps)

    # Embeddings: word + position + token type 0 (a single sentence), then LayerNorm.
    word_table = g.const("embeddings.word_embeddings.weight", get("embeddings.word_embeddings.weight"))
    pos_table = g.const(
        "embeddings.position_embeddings.weight", get("embeddings.position_embeddings.weight")
    )
    type0 = g.const("embeddings.token_type_embeddings.row0", get("embeddings.token_type_embeddings.weight")[0])
    words = g.op("Gather", [word_table, INPUT_IDS], "word_embeddings", axis=0)
    seq_len = g.op("Gather", [g.op("Shape", [INPUT_IDS], "ids_shape"), g.ints([1])], "seq_len", axis=0)
    positions = g.op("Slice", [pos_table, g.ints([0]), seq_len, g.ints([0])], "position_embeddings")
    x = g.op("Add", [g.op("Add", [words, positions], "emb_word_pos"), type0], "emb_sum")
    x = layer_norm(x, "embeddings.LayerNorm", "emb_out")

    # Additive attention mask [batch, 1, 1, sequence]: 0 for tokens, MASK_VALUE for padding.
    # Unsqueeze, Unsqueeze, Cast, Sub, Mul: the chain ORT's attention fusion looks for.
    mask_4d = g.op("Unsqueeze", [ATTENTION_MASK, g.ints([1])], "mask_unsqueeze1")
    mask_4d = g.op("Unsqueeze", [mask_4d, g.ints([2])], "mask_unsqueeze2")
    mask_4d = g.op("Cast", [mask_4d], "mask_4d", to=TensorProto.FLOAT)
    inverted = g.op("Sub", [g.scalar(1.0), mask_4d], "mask_inverted")
    additive_mask = g.op("Mul", [inverted, g.scalar(MASK_VALUE)], "mask_additive")

    split_heads = g.ints([0, 0, heads, head_size])
    merge_heads = g.ints([0, 0, hidden])
    sqrt2 = g.scalar(float(np.sqrt(2.0)))
    one, half = g.scalar(1.0), g.scalar(0.5)
    scale = g.scalar(float(np.sqrt(head_size)))

    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        n = f"l{i}"
        # Self-attention: [b, s, h] -> [b, heads, s, d] (keys as [b, heads, d, s]).
        q = g.op("Reshape", [linear(x, f"{p}.attention.self.query", i, "q"), split_heads], f"{n}_q_split")
        k = g.op("Reshape", [linear(x, f"{p}.attention.self.key", i, "k"), split_heads], f"{n}_k_split")
        v = g.op("Reshape", [linear(x, f"{p}.attention.self.value", i, "v"), split_heads], f"{n}_v_split")
        q = g.op("Transpose", [q], f"{n}_q_heads", perm=[0, 2, 1, 3])
        k = g.op("Transpose", [k], f"{n}_k_heads", perm=[0, 2, 3, 1])
        v = g.op("Transpose", [v], f"{n}_v_heads", perm=[0, 2, 1, 3])
        scores = g.op("Div", [g.op("MatMul", [q, k], f"{n}_qk"), scale], f"{n}_scores")
        scores = g.op("Add", [scores, additive_mask], f"{n}_scores_masked")
        probs = g.op("Softmax", [scores], f"{n}_probs", axis=-1)
        context = g.op("Transpose", [g.op("MatMul", [probs, v], f"{n}_ctx")], f"{n}_ctx_t", perm=[0, 2, 1, 3])
        context = g.op("Reshape", [context, merge_heads], f"{n}_ctx_merged")
        attn = linear(context, f"{p}.attention.output.dense", i, "attn_out")
        x = layer_norm(g.op("Add", [attn, x], f"{n}_attn_res"), f"{p}.attention.output.LayerNorm", f"{n}_attn_ln")

        # Feed-forward with exact (erf) GELU: x * 0.5 * (1 + erf(x / sqrt 2)).
        h = linear(x, f"{p}.intermediate.dense", i, "ffn_in")
        erf = g.op("Erf", [g.op("Div", [h, sqrt2], f"{n}_gelu_div")], f"{n}_gelu_erf")
        gelu = g.op("Mul", [h, g.op("Add", [erf, one], f"{n}_gelu_add")], f"{n}_gelu_mul")
        gelu = g.op("Mul", [gelu, half], f"{n}_gelu")
        ffn = linear(gelu, f"{p}.output.dense", i, "ffn_out")
        x = layer_norm(g.op("Add", [ffn, x], f"{n}_ffn_res"), f"{p}.output.LayerNorm", f"{n}_out")

    # Mean pooling over real tokens, then x / max(||x||, 1e-12), as sentence-transformers does.
    mask_float = g.op("Cast", [ATTENTION_MASK], "mask_float", to=TensorProto.FLOAT)
    mask_3d = g.op("Unsqueeze", [mask_float, g.ints([2])], "pool_mask")
    summed = g.op("ReduceSum", [g.op("Mul", [x, mask_3d], "pool_masked"), g.ints([1])], "pool_sum", keepdims=0)
    count = g.op("ReduceSum", [mask_float, g.ints([1])], "pool_count", keepdims=1)
    count = g.op("Max", [count, g.scalar(1e-9)], "pool_count_clamped")
    mean = g.op("Div", [summed, count], "pool_mean")
    norm = g.op("ReduceL2", [mean], "pool_norm", axes=[1], keepdims=1)  # axes input only from opset 18
    norm = g.op("Max", [norm, g.scalar(1e-12)], "pool_norm_clamped")
    g.op("Div", [mean, norm], OUTPUT)

    graph = helper.make_graph(
        g.nodes,
        "sentence_embedding",
        inputs=[
            helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch", "sequence"]),
        ],
        outputs=[helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", hidden])],
        initializer=g.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="inferlb",
        doc_string="BERT encoder + mean pooling + L2 normalisation (sentence-transformers).",
    )
    helper.set_model_props(
        model,
        {
            "dimensions": str(hidden),
            "vocab_size": str(config.vocab_size),
            "max_position_embeddings": str(config.max_position_embeddings),
        },
    )
    return model
