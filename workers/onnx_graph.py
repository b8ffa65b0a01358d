"""Build the all-MiniLM-L6-v2 forward pass as an ONNX graph from numpy weights.

Why by hand: exporting through torch would make torch (and gigabytes of CUDA)
a set-up dependency. The encoder is small and fixed, so it is spelled out
node by node here with ``onnx.helper``, in the node patterns ONNX Runtime
fuses (MatMul+Add, Div/Erf GELU).

Attention is the standard ``Attention`` op of opset 24, given the number of
real tokens of each row (``nonpad_kv_seqlen``) instead of a mask: on one CPU
core it beats both the spelled-out MatMul/Softmax chain and the
``com.microsoft`` MultiHeadAttention with a padding mask (which leaves ONNX
Runtime's flash-attention path). So ``attention_mask`` must be a prefix
mask: each row's real tokens first, then padding, as ``Engine`` pads.

The graph ends with sentence-transformers' pooling: the mean of the token
states over ``attention_mask``, then L2 normalisation, so the output is the
finished sentence embedding.

For the int8 model the same builder takes an ``Int8Prep`` (see
``plan_int8``), two rewrites that leave the fp32 result unchanged but make
dynamic int8 quantisation of the weight MatMuls accurate:

- SmoothQuant-style smoothing: a few activation channels (one LayerNorm
  channel reaches ~30 where most stay under 2) set the per-tensor int8 scale
  of a whole activation. Dividing each input channel by ``s`` and multiplying
  the matching weight row by ``s`` moves that range into the per-channel
  quantised weights. Before the attention output projection this folds into
  the value projection for free; elsewhere it costs one Mul.
- Outlier FFN channels: in four layers one or two of the 1536 GELU outputs
  reach 14-25 where the rest stay under ~7. Those channels get their own
  small fp32 path (``ffn_in_fp32``/``ffn_out_fp32`` MatMuls, kept out of the
  quantisation) and are removed from the int8 FFN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from workers.model_files import BertConfig

OPSET = 24  # Attention with nonpad_kv_seqlen arrived in opset 24; ORT 1.31 runs it on CPU.
IR_VERSION = 12  # the IR version that goes with opset 24
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "embedding"
# The input groups of the weight MatMuls: q, k and v share one input.
LINEAR_INPUTS = ("qkv", "attn_out", "ffn_in", "ffn_out")
# Smoothing exponent (SmoothQuant's alpha): 0 leaves activations alone, 1 moves all range into weights.
SMOOTHING_ALPHA = 0.6
# An FFN channel whose calibrated |GELU| maximum exceeds this multiple of the layer's
# median channel maximum goes to the fp32 path (at most MAX_FP32_FFN_CHANNELS). Here the
# medians are ~1.1; the outliers reach 14-25 and the next largest channels 4-7.
FFN_OUTLIER_RATIO = 8.0
MAX_FP32_FFN_CHANNELS = 4


@dataclass(frozen=True)
class Int8Prep:
    """Exact rewrites of the graph that make dynamic int8 quantisation accurate.

    ``smoothing[(layer, group)]``: per-input-channel factors ``s`` for a group
    of ``LINEAR_INPUTS``; the activation is divided by ``s`` and the weight rows
    multiplied by it. ``fp32_ffn_channels[layer]``: intermediate channels
    computed on an fp32 path outside the int8 FFN.
    """

    smoothing: Mapping[tuple[int, str], np.ndarray] = field(default_factory=dict)
    fp32_ffn_channels: Mapping[int, Sequence[int]] = field(default_factory=dict)


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
    """Name of a layer's Linear MatMul node.

    part: q, k, v, attn_out, ffn_in, ffn_out, or ffn_in_fp32/ffn_out_fp32 (the
    outlier-channel path, which quantisation must leave alone).
    """
    return f"l{layer}_{part}_matmul"


def linear_input_name(layer: int, group: str) -> str:
    """Name of the (unsmoothed) tensor that feeds a group of ``LINEAR_INPUTS``; for calibration."""
    if group == "qkv":
        return "emb_out" if layer == 0 else f"l{layer - 1}_out"
    return {"attn_out": f"l{layer}_ctx", "ffn_in": f"l{layer}_attn_ln", "ffn_out": f"l{layer}_gelu"}[group]


def _weight_lookup(weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Accept checkpoints saved from BertModel ("embeddings...") or with a "bert." prefix."""
    if "embeddings.word_embeddings.weight" in weights:
        return weights
    prefix = "bert."
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def _group_weights(layer: int, group: str) -> tuple[str, ...]:
    p = f"encoder.layer.{layer}"
    return {
        "qkv": tuple(f"{p}.attention.self.{m}.weight" for m in ("query", "key", "value")),
        "attn_out": (f"{p}.attention.output.dense.weight",),
        "ffn_in": (f"{p}.intermediate.dense.weight",),
        "ffn_out": (f"{p}.output.dense.weight",),
    }[group]


def plan_int8(
    weights: Mapping[str, np.ndarray],
    config: BertConfig,
    activation_absmax: Mapping[tuple[int, str], np.ndarray],
    *,
    smooth: Sequence[str] = ("qkv", "attn_out", "ffn_in"),
    alpha: float = SMOOTHING_ALPHA,
    outlier_ratio: float = FFN_OUTLIER_RATIO,
) -> Int8Prep:
    """The ``Int8Prep`` for calibrated per-channel |activation| maxima (keyed like ``smoothing``).

    Smoothing factor per input channel j: ``max|X_j| ** alpha / max|W_j| ** (1 - alpha)``.
    The GELU output (``ffn_out``) is better served by the fp32 outlier path than by
    smoothing, which would cost a Mul over all 1536 channels.
    """
    w = _weight_lookup(weights)
    smoothing: dict[tuple[int, str], np.ndarray] = {}
    fp32_channels: dict[int, list[int]] = {}
    for layer in range(config.num_layers):
        for group in smooth:
            x_max = np.asarray(activation_absmax[(layer, group)], dtype=np.float64)
            # torch Linear weights are [out, in]: the max over out per input channel.
            w_max = np.max(
                [np.abs(np.asarray(w[name], dtype=np.float64)).max(axis=0) for name in _group_weights(layer, group)],
                axis=0,
            )
            s = np.maximum(x_max, 1e-5) ** alpha / np.maximum(w_max, 1e-5) ** (1.0 - alpha)
            smoothing[(layer, group)] = s.astype(np.float32)
        gelu_max = np.asarray(activation_absmax[(layer, "ffn_out")], dtype=np.float64)
        threshold = outlier_ratio * np.median(gelu_max)
        outliers = [int(j) for j in np.argsort(gelu_max)[::-1][:MAX_FP32_FFN_CHANNELS] if gelu_max[j] > threshold]
        if outliers:
            fp32_channels[layer] = sorted(outliers)
    return Int8Prep(smoothing=smoothing, fp32_ffn_channels=fp32_channels)


class _Encoder:
    """The encoder's parts as graph nodes, for one build: a checkpoint's weights (``get``), the int8
    rewrites of ``prep`` and the nodes they become (``g``)."""

    def __init__(self, weights: Mapping[str, np.ndarray], config: BertConfig, prep: Int8Prep) -> None:
        self.w, self.config, self.prep = weights, config, prep
        self.g = g = _GraphBuilder()
        self.sqrt2 = g.scalar(float(np.sqrt(2.0)))  # GELU's constants, the graph's first initialisers
        self.one, self.half = g.scalar(1.0), g.scalar(0.5)

    def get(self, name: str) -> np.ndarray:
        if name not in self.w:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return np.asarray(self.w[name], dtype=np.float32)

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray, layer: int, part: str) -> str:
        """x @ weight + bias, with weight already [in, out] (torch Linear stores [out, in])."""
        g = self.g
        weight_name = g.const(f"l{layer}_{part}.weight", weight.astype(np.float32))
        bias_name = g.const(f"l{layer}_{part}.bias", bias.astype(np.float32))
        product = g.op("MatMul", [x, weight_name], linear_node_name(layer, part))
        return g.op("Add", [product, bias_name], f"l{layer}_{part}")

    def smoothed(self, x: str, layer: int, group: str, channels: np.ndarray | None = None
                 ) -> tuple[str, np.ndarray | None]:
        """Divide x's channels by the group's smoothing factors (those of ``channels`` only, if given)."""
        s = self.prep.smoothing.get((layer, group))
        if s is None:
            return x, None
        if channels is not None:
            s = s[channels]
        inverse = self.g.const(f"l{layer}_{group}.smoothing", (1.0 / s).astype(np.float32))
        return self.g.op("Mul", [x, inverse], f"l{layer}_{group}_smoothed"), s

    def layer_norm(self, x: str, prefix: str, out: str) -> str:
        gamma = self.g.const(f"{prefix}.weight", self.get(f"{prefix}.weight"))
        beta = self.g.const(f"{prefix}.bias", self.get(f"{prefix}.bias"))
        return self.g.op("LayerNormalization", [x, gamma, beta], out, axis=-1, epsilon=self.config.layer_norm_eps)

    def gelu(self, h: str, out: str) -> str:
        """Exact (erf) GELU: h * 0.5 * (1 + erf(h / sqrt 2)); ONNX Runtime fuses the pattern."""
        g = self.g
        erf = g.op("Erf", [g.op("Div", [h, self.sqrt2], f"{out}_div")], f"{out}_erf")
        product = g.op("Mul", [h, g.op("Add", [erf, self.one], f"{out}_add")], f"{out}_mul")
        return g.op("Mul", [product, self.half], out)

    def embeddings(self) -> str:
        """Word + position + token type 0 (a single sentence), then LayerNorm."""
        g, get = self.g, self.get
        word_table = g.const("embeddings.word_embeddings.weight", get("embeddings.word_embeddings.weight"))
        pos_table = g.const(
            "embeddings.position_embeddings.weight", get("embeddings.position_embeddings.weight")
        )
        type0 = g.const("embeddings.token_type_embeddings.row0", get("embeddings.token_type_embeddings.weight")[0])
        words = g.op("Gather", [word_table, INPUT_IDS], "word_embeddings", axis=0)
        seq_len = g.op("Gather", [g.op("Shape", [INPUT_IDS], "ids_shape"), g.ints([1])], "seq_len", axis=0)
        positions = g.op("Slice", [pos_table, g.ints([0]), seq_len, g.ints([0])], "position_embeddings")
        x = g.op("Add", [g.op("Add", [words, positions], "emb_word_pos"), type0], "emb_sum")
        return self.layer_norm(x, "embeddings.LayerNorm", "emb_out")

    def attention(self, i: int, x: str, kv_lengths: str, exposed: list[str]) -> str:
        """Layer ``i``'s self-attention on [batch, sequence, hidden] tensors (Attention splits the heads),
        its residual and LayerNorm."""
        g, get, p, n = self.g, self.get, f"encoder.layer.{i}", f"l{i}"
        x_qkv, s_qkv = self.smoothed(x, i, "qkv")
        s_ctx = self.prep.smoothing.get((i, "attn_out"))
        value_w, value_b = get(f"{p}.attention.self.value.weight").T, get(f"{p}.attention.self.value.bias")
        if s_ctx is not None:  # context = probs @ v, so dividing v's channels divides the context's
            value_w, value_b = value_w / s_ctx[None, :], value_b / s_ctx
        q_w, q_b = get(f"{p}.attention.self.query.weight").T, get(f"{p}.attention.self.query.bias")
        k_w, k_b = get(f"{p}.attention.self.key.weight").T, get(f"{p}.attention.self.key.bias")
        q = self.linear(x_qkv, _rows(q_w, s_qkv), q_b, i, "q")
        k = self.linear(x_qkv, _rows(k_w, s_qkv), k_b, i, "k")
        v = self.linear(x_qkv, _rows(value_w, s_qkv), value_b, i, "v")
        heads = self.config.num_heads
        context = g.op(
            "Attention", [q, k, v, "", "", "", kv_lengths], f"{n}_ctx", q_num_heads=heads, kv_num_heads=heads
        )
        exposed.append(context)
        o_w, o_b = get(f"{p}.attention.output.dense.weight").T, get(f"{p}.attention.output.dense.bias")
        attn = self.linear(context, _rows(o_w, s_ctx), o_b, i, "attn_out")
        x = self.layer_norm(g.op("Add", [attn, x], f"{n}_attn_res"), f"{p}.attention.output.LayerNorm",
                            f"{n}_attn_ln")
        exposed.append(x)
        return x

    def feed_forward(self, i: int, x: str, exposed: list[str]) -> str:
        """Layer ``i``'s feed-forward, its residual and LayerNorm; outlier channels (if any) on their own
        fp32 path."""
        g, get, p, n = self.g, self.get, f"encoder.layer.{i}", f"l{i}"
        w_in, b_in = get(f"{p}.intermediate.dense.weight").T, get(f"{p}.intermediate.dense.bias")
        w_out = get(f"{p}.output.dense.weight").T
        outliers = np.asarray(self.prep.fp32_ffn_channels.get(i, ()), dtype=np.int64)
        fp32_part = None
        if outliers.size:
            h_fp32 = self.linear(x, w_in[:, outliers], b_in[outliers], i, "ffn_in_fp32")
            fp32_part = g.op(
                "MatMul",
                [self.gelu(h_fp32, f"{n}_gelu_fp32"), g.const(f"l{i}_ffn_out_fp32.weight", w_out[outliers])],
                linear_node_name(i, "ffn_out_fp32"),
            )
            keep = np.setdiff1d(np.arange(w_in.shape[1]), outliers)
            w_in, b_in, w_out = w_in[:, keep], b_in[keep], w_out[keep]
        else:
            keep = np.arange(w_in.shape[1])
        x_in, s_in = self.smoothed(x, i, "ffn_in")
        h = self.gelu(self.linear(x_in, _rows(w_in, s_in), b_in, i, "ffn_in"), f"{n}_gelu")
        exposed.append(h)
        h, s_out = self.smoothed(h, i, "ffn_out", keep)
        ffn = self.linear(h, _rows(w_out, s_out), get(f"{p}.output.dense.bias"), i, "ffn_out")
        residual = g.op("Add", [ffn, x], f"{n}_ffn_res")
        if fp32_part is not None:
            residual = g.op("Add", [residual, fp32_part], f"{n}_ffn_res_fp32")
        return self.layer_norm(residual, f"{p}.output.LayerNorm", f"{n}_out")

    def pooling(self, x: str) -> None:
        """Mean pooling over real tokens, then x / max(||x||, 1e-12), as sentence-transformers does."""
        g = self.g
        mask_float = g.op("Cast", [ATTENTION_MASK], "mask_float", to=TensorProto.FLOAT)
        mask_3d = g.op("Unsqueeze", [mask_float, g.ints([2])], "pool_mask")
        summed = g.op("ReduceSum", [g.op("Mul", [x, mask_3d], "pool_masked"), g.ints([1])], "pool_sum", keepdims=0)
        count = g.op("ReduceSum", [mask_float, g.ints([1])], "pool_count", keepdims=1)
        count = g.op("Max", [count, g.scalar(1e-9)], "pool_count_clamped")
        mean = g.op("Div", [summed, count], "pool_mean")
        norm = g.op("ReduceL2", [mean, g.ints([1])], "pool_norm", keepdims=1)
        norm = g.op("Max", [norm, g.scalar(1e-12)], "pool_norm_clamped")
        g.op("Div", [mean, norm], OUTPUT)


def _rows(weight: np.ndarray, s: np.ndarray | None) -> np.ndarray:
    """``weight``'s input rows multiplied by the smoothing factors ``s`` (as they are without)."""
    return weight if s is None else weight * s[:, None]


def build_embedding_graph(
    weights: Mapping[str, np.ndarray],
    config: BertConfig,
    prep: Int8Prep | None = None,
    *,
    expose_linear_inputs: bool = False,
) -> onnx.ModelProto:
    """Return the ONNX model: (input_ids, attention_mask) -> L2-normalised mean-pooled embedding.

    Both inputs are int64 [batch, sequence], right-padded; the output is float32
    [batch, hidden]. Padded positions (attention_mask 0) influence neither
    attention nor pooling. ``prep`` rewrites the graph for int8 quantisation
    (same fp32 result). ``expose_linear_inputs`` adds the ``linear_input_name``
    tensors as extra outputs, for calibration.
    """
    encoder = _Encoder(_weight_lookup(weights), config, prep or Int8Prep())
    x = encoder.embeddings()
    # Real tokens per row: attention ignores keys at and beyond it (right padding).
    kv_lengths = encoder.g.op("ReduceSum", [ATTENTION_MASK, encoder.g.ints([1])], "kv_lengths", keepdims=0)
    exposed: list[str] = []
    for i in range(config.num_layers):
        exposed.append(x)
        x = encoder.feed_forward(i, encoder.attention(i, x, kv_lengths, exposed), exposed)
    encoder.pooling(x)
    return _model(encoder.g, config, exposed if expose_linear_inputs else [])


def _model(g: _GraphBuilder, config: BertConfig, extra_outputs: Sequence[str]) -> onnx.ModelProto:
    """The model of ``g``'s nodes: the two inputs, the embedding and ``extra_outputs``, and its facts."""
    hidden = config.hidden_size
    outputs = [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", hidden])]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in extra_outputs]
    graph = helper.make_graph(
        g.nodes,
        "sentence_embedding",
        inputs=[
            helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch", "sequence"]),
        ],
        outputs=outputs,
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
