"""Every CPU precision mode through the whole engine: it runs, it is repeatable, and the modes that
promise batch invariance keep it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from chattts_serve.engine.calibrate import calibrate
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.engine import Engine
from chattts_serve.kernels.linear import packing_available
from chattts_serve.kernels.quant import StaticInt8Linear
from chattts_serve.models.chattts import checkpoint
from chattts_serve.models.chattts.tokenizer import Tokenizer
from chattts_serve.sampling_params import SamplingParams

PARAMS = SamplingParams(seed=5, max_new_tokens=24, refine_text=False)
TEXTS = ["你好，世界。", "Hello there, my friend.", "Good morning."]


@pytest.fixture(scope="module", params=["bf16", "int8", "int8-dynamic", "int8-static", "int4"])
def engine(request, tiny_ckpt):
    return Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(4, precision=request.param))


def test_mode_synthesizes_and_repeats(engine):
    a = engine.synthesize(TEXTS, PARAMS)
    b = engine.synthesize(TEXTS, PARAMS)
    for x, y in zip(a, b, strict=True):
        assert x.codes.shape[0] > 0 and np.isfinite(x.audio).all()
        np.testing.assert_array_equal(x.codes, y.codes)


def test_batch_invariance_where_promised(engine):
    if engine.precision.name == "int8-dynamic":  # one activation scale per call: documented as not batch-invariant
        pytest.skip("int8-dynamic does not promise batch invariance")
    batched = engine.synthesize(TEXTS, PARAMS)[1]
    alone = engine.synthesize(TEXTS[1:2], PARAMS)[0]
    np.testing.assert_array_equal(batched.codes, alone.codes)


def test_int4_runs_its_code_heads_in_bf16_the_others_in_fp32(engine):
    bf16 = engine.precision.name == "int4" and packing_available(torch.device("cpu"), torch.bfloat16)
    assert engine.model.embed.code_heads_dtype == (torch.bfloat16 if bf16 else torch.float32)


def test_precision_is_reported_and_fp16_refused_on_cpu(tiny_ckpt):
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        Engine.from_pretrained(tiny_ckpt, config=EngineConfig(precision="fp16"))
    with pytest.raises(ValueError, match="precision must be one of"):
        Engine.from_pretrained(tiny_ckpt, config=EngineConfig(precision="int3"))


def test_calibration_sees_every_projection(tiny_ckpt):
    model = checkpoint.load(tiny_ckpt)
    tok = Tokenizer(model.root / checkpoint.TOKENIZER_DIR)
    absmax = calibrate(model, tok, None, texts=("你好。",), audio_steps=4, refine_steps=4)
    names = {n for n, m in model.gpt.named_modules() if isinstance(m, nn.Linear)}
    assert set(absmax) == names and all(v > 0 for v in absmax.values())


def test_static_engine_uses_calibrated_scales(tiny_ckpt):
    e = Engine.from_pretrained(tiny_ckpt, config=EngineConfig.with_slots(2, precision="int8-static"))
    mods = [m for m in e.model.gpt.modules() if isinstance(m, StaticInt8Linear)]
    assert mods and len({m.x_scale for m in mods}) > 1
