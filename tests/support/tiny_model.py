"""The tiny random ChatTTS checkpoint prepared for the runner at a precision, as the engine prepares it: the
runner's tests (batched and chunked prefill) build their ``ModelRunner`` on this."""

from __future__ import annotations

import torch

from chattts_serve.kernels.quant import parse_precision, record_absmax
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.prepare import prepare_model


def prepared(tiny_ckpt, precision: str, slots: int, **kwargs):
    """``(model, layout)``: ``tiny_ckpt`` loaded and prepared for ``slots`` slots at ``precision``; int8-static
    calibrates its activation ranges on one fp32 pass of seeded noise. ``kwargs`` go to ``prepare_model``."""
    model = checkpoint.load(tiny_ckpt)
    hidden = model.config.gpt.hidden_size

    def calibrate(m):
        x = torch.randn(1, 16, hidden, generator=torch.Generator().manual_seed(9))
        cache = m.gpt.new_cache(1, 16)
        return record_absmax(m.gpt, lambda: m.gpt(x, torch.arange(16)[None], cache, torch.tensor([0]), 0))

    with torch.inference_mode():
        layout = prepare_model(model, parse_precision(precision), slots, calibrate=calibrate, **kwargs)
    return model, layout
