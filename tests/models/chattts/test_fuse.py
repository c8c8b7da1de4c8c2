"""Fused q/k/v and gate/up projections compute what the separate ones do."""

from __future__ import annotations

import torch

from chattts_serve.models.chattts.checkpoint import load
from chattts_serve.models.chattts.gpt import fuse_projections_


@torch.inference_mode()
def test_fused_trunk_matches_separate_projections(tiny_ckpt):
    sep, fused = load(tiny_ckpt).gpt, load(tiny_ckpt).gpt
    fuse_projections_(fused)
    fuse_projections_(fused)  # idempotent
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    assert mlp.gate_up_proj is not None and not hasattr(mlp, "up_proj")
    torch.manual_seed(0)
    emb = torch.randn(1, 12, sep.cfg.hidden_size)
    outs = []
    for gpt in (sep, fused):
        cache = gpt.new_cache(2, 32)
        h = gpt(emb, torch.arange(12)[None], cache, torch.tensor([1]), 0, last_only=False)
        d = gpt.decode(emb[0, :2], cache, [1, 0], [12, 0])
        outs.append((h, d))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
