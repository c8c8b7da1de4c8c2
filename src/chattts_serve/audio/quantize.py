"""The audio graph (``audio.cpu_graph``) in int8: nncf's post-training quantization, or int8 weights with
activations the OpenVINO plugin quantizes at run time.

``kind``:

- ``all``: every convolution and MatMul, weights and activations (nncf's PERFORMANCE preset).
- ``linears``: only MatMuls (the ConvNeXt blocks' pointwise linears: ~96 % of the stage's MACs), the head's
  projection left out (its output is exponentiated into magnitudes: an error there is multiplied); MIXED preset
  (asymmetric activations: a GELU's output is one-sided).
- ``smooth``: ``linears`` with SmoothQuant (nncf's TRANSFORMER model type) at ``alpha``.
- ``dynamic``: the same MatMuls' weights in int8 per output channel (``nncf.compress_weights``), no calibration;
  compile with ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` and the plugin quantizes activations per group at run time.

The static kinds calibrate on hidden states the model itself makes (``calibration_hidden``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..models.chattts.config import NUM_AUDIO_TOKENS

KINDS = ("all", "linears", "smooth", "dynamic")
INT8_KIND = "smooth"
"""The kind ``--audio-dtype ov-int8`` runs: on the full-size checkpoint, one thread, a 1 x 150 window, 67x real time
at 34 dB against torch fp32 (ov-bf16: 42x, 36 dB; ``all``: 71x, 20 dB; ``linears``: 59x, 22 dB; ``dynamic``:
52x, 30 dB at groups of 128; BENCHMARKS.md)."""
SMOOTH_ALPHA = 0.5
DYNAMIC_GROUP = 32
"""Input channels per activation scale of the ``dynamic`` kind (``DYNAMIC_QUANTIZATION_GROUP_SIZE``)."""


def calibration_hidden(model: Any, lengths: tuple[int, ...] = (150, 64), prompt: int = 24, seed: int = 0) -> list:
    """Hidden states [1, n, hidden] (numpy) for each of ``lengths``: the model's GPT (torch, as loaded) over a
    prompt of random text tokens and random audio codes, read in one pass: the trunk's own output scale and
    statistics, no data set needed. Fixed seed: a checkpoint quantizes the same way every load.

    Under the ort-* precisions the torch GPT is on the meta device by now (``prepare``): its weights are then read
    again from the checkpoint for this pass (memory-mapped, seconds) and let go after it."""
    if next(model.gpt.parameters()).is_meta:
        from ..models.chattts.checkpoint import load

        model = load(model.root)
    gpt, cfg = model.gpt, model.config.gpt
    g = torch.Generator().manual_seed(seed)
    feeds = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.zeros(1, prompt + n, cfg.num_vq, dtype=torch.long)
            ids[0, :prompt] = torch.randint(0, cfg.num_text_tokens, (prompt, 1), generator=g)
            ids[0, prompt:] = torch.randint(0, NUM_AUDIO_TOKENS - 1, (n, cfg.num_vq), generator=g)
            mask = torch.zeros(1, prompt + n, dtype=torch.bool)
            mask[0, :prompt] = True
            emb = model.embed.embed_prompt(ids, mask)
            cache = gpt.new_cache(1, prompt + n)
            positions = torch.arange(prompt + n)[None]
            dtype = gpt.norm.weight.dtype
            h = gpt(emb.to(dtype), positions, cache, torch.zeros(1, dtype=torch.long), 0, None, last_only=False)
            feeds.append(np.ascontiguousarray(h.float()[:, prompt - 1 : prompt - 1 + n].numpy()))
    return feeds


def head_projection(graph: Any) -> str:
    """The friendly name of the MatMul that makes the graph's output (the Vocos head's projection)."""
    node = graph.get_results()[0].input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        node = node.input_value(0).get_node()
    return node.get_friendly_name()


def quantize(graph: Any, feeds: list, kind: str, alpha: float = 0.5) -> Any:
    """``graph`` (an OpenVINO model of ``cpu_graph.convert``) quantized as ``kind`` (see the module)."""
    if kind not in KINDS:
        raise ValueError(f"int8 kind must be one of {', '.join(KINDS)}; got {kind!r}")
    import nncf

    from ..kernels.openvino import quiet_nncf

    with quiet_nncf():
        return _quantize(nncf, graph, feeds, kind, alpha)


def _quantize(nncf: Any, graph: Any, feeds: list, kind: str, alpha: float) -> Any:
    head = nncf.IgnoredScope(names=[head_projection(graph)])
    if kind == "dynamic":
        return nncf.compress_weights(graph, mode=nncf.CompressWeightsMode.INT8_SYM, ignored_scope=head)
    kw: dict[str, Any] = {"subset_size": len(feeds), "fast_bias_correction": True}
    if kind != "all":
        kw["preset"] = nncf.QuantizationPreset.MIXED
        kw["ignored_scope"] = nncf.IgnoredScope(names=head.names, types=["Convolution", "GroupConvolution"])
    if kind == "smooth":
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

        kw["model_type"] = nncf.ModelType.TRANSFORMER
        kw["advanced_parameters"] = AdvancedQuantizationParameters(
            smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha)
        )
    return nncf.quantize(graph, nncf.Dataset(feeds), **kw)


def int8_graph(model: Any, graph: Any) -> Any:
    """``graph`` as ``--audio-dtype ov-int8`` runs it: ``INT8_KIND``, calibrated on the model's own hidden states."""
    return quantize(graph, calibration_hidden(model), INT8_KIND, SMOOTH_ALPHA)
