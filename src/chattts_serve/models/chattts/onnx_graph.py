"""The GPT trunk as an ONNX graph for ONNX Runtime (the ``ort-*`` precisions), written from the weights.

The graph is built node by node from the loaded fp32 weights instead of traced from ``models.chattts.gpt``:
the step we want is not one torch can trace. Attention is ORT's ``GroupQueryAttention`` contrib op,
which reads and writes the engine's KV slot cache **in place** (past and present bound to the same
buffer), scores only each row's own ``seqlens_k + 1`` keys, applies the rotary embedding itself and
lets an idle row (``query_seqlens = 0``) through untouched. So a decode step passes the cache as
per-layer inputs with no per-step copy, and one graph serves prefill (B rows of up to S tokens, right-
padded; positions past a row's ``query_seqlens`` come out as zeros) and decode (B rows, one token each).

Graph (names are the ONNX input/output names)::

    embeds [B, S, hidden] float32          the summed input embeddings (computed in torch)
    seqlens_k [B] int32                    cached positions after this step, minus 1
    total_sequence_length [] int32         max(seqlens_k) + 1 (an upper bound, see the op's doc)
    query_seqlens [B] int32                new tokens per row (0: idle row, left as it is)
    past_key_{i}, past_value_{i}           [B, kv_heads, capacity, head_dim] float32 per layer
    -> hidden [B, S, hidden]               final-norm hidden states
    -> present_key_{i}, present_value_{i}  the same buffers as past (bind them to the same memory)

Per layer: RMSNorm (``SimplifiedLayerNormalization``; later ones fused with the residual add as
``SkipSimplifiedLayerNormalization``), one q/k/v MatMul, GQA (rotate-half RoPE from fp32 cos/sin
tables, the same values ``models.chattts.gpt`` uses), o_proj MatMul, SwiGLU with one gate/up MatMul. The
weights are the only thing ``kernels.onnx_quant`` changes.

This is ``models.chattts.gpt.DecoderLayer.forward`` (the one torch layer, which every torch call shape runs)
spelled in ONNX ops, with its weights read from that module (``_layer_weights``). It is written rather than
traced because what makes the step fast has no torch op to trace: GroupQueryAttention's in-place cache (past
and present bound to one buffer) and idle rows, and ORT's fused residual norms. ``tests/models/chattts/
test_onnx.py`` holds it to the torch layer (ort-fp32 against ``GPT`` over prefill and decode steps).
"""

from __future__ import annotations

import torch

from .config import GPTConfig
from .gpt import GPT, rope_inv_freq

OPSET = 21


def _layer_weights(gpt: GPT, i: int) -> dict[str, torch.Tensor]:
    """fp32 [in, out] MatMul weights of layer i (fused or not) and its two norm weights."""
    layer = gpt.layers[i]
    a, m = layer.self_attn, layer.mlp
    if a.qkv_proj is not None:
        qkv = a.qkv_proj.weight
    else:
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    gate_up = m.gate_up_proj.weight if m.gate_up_proj is not None else torch.cat([m.gate_proj.weight, m.up_proj.weight])
    for name, w in (("qkv", qkv), ("gate_up", gate_up)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
            raise ValueError(f"layer {i} {name}: export needs the fp32 model as loaded (got {type(w).__name__})")
    return {
        "qkv": qkv.detach().t(),
        "o": a.o_proj.weight.detach().t(),
        "gate_up": gate_up.detach().t(),
        "down": m.down_proj.weight.detach().t(),
        "input_norm": layer.input_layernorm.weight.detach(),
        "post_norm": layer.post_attention_layernorm.weight.detach(),
    }


def rope_tables(cfg: GPTConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim / 2]: the values ``models.chattts.gpt.rope_cos_sin`` computes (fp32)."""
    freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(cfg.head_dim, cfg.rope_theta).float()
    return freqs.cos(), freqs.sin()


_GQA_INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
)
"""GroupQueryAttention's inputs in order (ORT 1.32 schema); optional ones left out are ``""``."""


def _gqa_inputs(**given: str) -> list[str]:
    unknown = set(given) - set(_GQA_INPUTS)
    if unknown:
        raise ValueError(f"not GroupQueryAttention inputs: {sorted(unknown)}")
    names = [given.get(n, "") for n in _GQA_INPUTS]
    while names and not names[-1]:
        names.pop()
    return names


def build_graph(gpt: GPT, max_positions: int | None = None):
    """The fp32 trunk step as an ``onnx.ModelProto`` (weights as initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    cfg = gpt.cfg
    max_positions = max_positions or cfg.max_position_embeddings
    nodes: list = []
    inits: list = []

    def init(name: str, t: torch.Tensor) -> str:
        t = t.detach().float() if t.is_floating_point() else t
        inits.append(numpy_helper.from_array(t.contiguous().numpy(), name))
        return name

    def node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "_node", domain=domain, **attrs))
        return outputs

    eps = cfg.rms_norm_eps
    cos, sin = rope_tables(cfg, max_positions)
    init("rope_cos", cos)
    init("rope_sin", sin)
    split = init("gate_up_split", torch.tensor([cfg.intermediate_size] * 2, dtype=torch.int64))

    batch, seq, cap = "batch", "seq", "capacity"
    kv_shape = [batch, cfg.num_kv_heads, cap, cfg.head_dim]
    inputs = [
        helper.make_tensor_value_info("embeds", TensorProto.FLOAT, [batch, seq, cfg.hidden_size]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, [batch]),
    ]
    outputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [batch, seq, cfg.hidden_size])]

    # Positions past a row's query_seqlens (an idle row's every position; a short prompt's right
    # padding in a batched prefill) get an unspecified attention output from the op; zero it, so that
    # they stay exact zeros and never reach a neighbour (int8's per-call activation scale sees them).
    node("Shape", ["embeds"], ["seq_len_1"], start=1, end=2)  # [S]
    node("Squeeze", ["seq_len_1"], ["seq_len"])
    node("Cast", ["seq_len"], ["seq_len_i32"], to=TensorProto.INT32)
    zero_i32 = init("zero_i32", torch.zeros((), dtype=torch.int32))
    node("Range", [zero_i32, "seq_len_i32", init("one_i32", torch.ones((), dtype=torch.int32))], ["positions"])
    node("Unsqueeze", ["query_seqlens", init("axes_1", torch.ones(1, dtype=torch.int64))], ["qs_col"])  # [B, 1]
    node("Less", ["positions", "qs_col"], ["active_2d"])  # [B, S]
    node("Unsqueeze", ["active_2d", init("axes_2", torch.tensor([2]))], ["active"])  # [B, S, 1]
    zero = init("zero_f32", torch.zeros(()))

    h = "embeds"  # the residual stream
    pending: str | None = None  # the last block's output, not yet added to h
    for i in range(cfg.num_layers):
        w = _layer_weights(gpt, i)
        p = f"l{i}_"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", TensorProto.FLOAT, kv_shape))
        norm_w = init(p + "input_norm", w["input_norm"])
        if pending is None:
            (x,) = node("SimplifiedLayerNormalization", [h, norm_w], [p + "x"], axis=-1, epsilon=eps)
        else:
            x, _, _, h = node(
                "SkipSimplifiedLayerNormalization",
                [pending, h, norm_w],
                [p + "x", p + "mean0", p + "inv_std0", p + "h0"],
                domain="com.microsoft",
                epsilon=eps,
            )
        (qkv,) = node("MatMul", [x, init(p + "qkv", w["qkv"])], [p + "qkv_out"])
        attn, _, _ = node(
            "GroupQueryAttention",
            _gqa_inputs(
                query=qkv,  # packed q, k, v
                past_key=f"past_key_{i}",
                past_value=f"past_value_{i}",
                seqlens_k="seqlens_k",
                total_sequence_length="total_sequence_length",
                cos_cache="rope_cos",
                sin_cache="rope_sin",
                query_seqlens="query_seqlens",
            ),
            [p + "attn", f"present_key_{i}", f"present_value_{i}"],
            domain="com.microsoft",
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=cfg.head_dim**-0.5,
        )
        (attn,) = node("Where", ["active", attn, zero], [p + "attn_active"])
        (o,) = node("MatMul", [attn, init(p + "o", w["o"])], [p + "o_out"])
        x, _, _, h = node(
            "SkipSimplifiedLayerNormalization",
            [o, h, init(p + "post_norm", w["post_norm"])],
            [p + "x1", p + "mean1", p + "inv_std1", p + "h1"],
            domain="com.microsoft",
            epsilon=eps,
        )
        (gu,) = node("MatMul", [x, init(p + "gate_up", w["gate_up"])], [p + "gu"])
        gate, up = node("Split", [gu, split], [p + "gate", p + "up"], axis=-1)
        (sig,) = node("Sigmoid", [gate], [p + "sig"])
        (silu,) = node("Mul", [gate, sig], [p + "silu"])
        (act,) = node("Mul", [silu, up], [p + "act"])
        (pending,) = node("MatMul", [act, init(p + "down", w["down"])], [p + "down_out"])
    node(
        "SkipSimplifiedLayerNormalization",
        [pending, h, init("final_norm", gpt.norm.weight.detach())],
        ["hidden"],
        domain="com.microsoft",
        epsilon=eps,
    )
    graph = helper.make_graph(nodes, "chattts_gpt_step", inputs, outputs, inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="chattts-serve",
    )
    model.ir_version = 10  # onnx's checker knows none of ORT's contrib ops: ORT checks at load
    return model
