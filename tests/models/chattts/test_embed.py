"""models/chattts/embed.py: weight-norm folding, prompt embedding, head row order and the bf16 code heads."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.kernels.linear import packing_available
from chattts_serve.models.chattts.config import GPTConfig
from chattts_serve.models.chattts.embed import Embed, fold_weight_norm
from tests.support.host_syncs import host_syncs

# Text vocab larger than the audio vocab, so text ids that are out of range for the code
# embeddings prove that text positions never reach them.
CFG = GPTConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32, num_text_tokens=900)


def make_embed(seed: int = 0) -> Embed:
    torch.manual_seed(seed)
    e = Embed(CFG)
    with torch.no_grad():
        e.head_text.normal_()
        e.head_code.normal_()
    return e.eval()


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 5), (626, 16)])
def test_fold_weight_norm_rowwise(rows, cols):
    torch.manual_seed(rows)
    g = torch.rand(rows, 1) + 0.5
    v = torch.randn(rows, cols)
    w = fold_weight_norm(g, v)
    assert w.shape == (rows, cols)
    for r in range(rows):
        expected = g[r, 0].double() * v[r].double() / v[r].double().norm()
        torch.testing.assert_close(w[r].double(), expected, rtol=1e-5, atol=1e-6)
    # each row's norm equals its gain
    torch.testing.assert_close(w.norm(dim=1), g[:, 0], rtol=1e-5, atol=1e-6)


def test_embed_prompt_text_and_code_positions():
    e = make_embed()
    b, t = 2, 6
    torch.manual_seed(1)
    text_mask = torch.tensor([[False, True, True, True, False, False], [True, True, False, False, False, True]])
    ids = torch.randint(0, CFG.num_audio_tokens, (b, t, CFG.num_vq))
    text_ids = torch.randint(CFG.num_audio_tokens, CFG.num_text_tokens, (b, t))  # >= 626 on purpose
    ids[text_mask] = text_ids[text_mask][:, None].expand(-1, CFG.num_vq)
    with torch.no_grad():
        out = e.embed_prompt(ids, text_mask)
    assert out.shape == (b, t, CFG.hidden_size)
    for bi in range(b):
        for ti in range(t):
            if text_mask[bi, ti]:
                expected = e.emb_text.weight[ids[bi, ti, 0]]
            else:
                expected = sum(e.emb_code[q].weight[ids[bi, ti, q]] for q in range(CFG.num_vq))
            torch.testing.assert_close(out[bi, ti], expected, rtol=1e-6, atol=1e-6)


def test_embed_prompt_without_text_is_code_sum():
    e = make_embed(2)
    ids = torch.randint(0, CFG.num_audio_tokens, (1, 3, CFG.num_vq))
    with torch.no_grad():
        out = e.embed_prompt(ids, torch.zeros(1, 3, dtype=torch.bool))
        torch.testing.assert_close(out, e.embed_codes(ids))


def embed_and_hidden(seed: int, rows: int) -> tuple[Embed, torch.Tensor]:
    """Random heads and ``rows`` random hidden states."""
    e = make_embed(seed)
    torch.manual_seed(seed + 1)
    return e, torch.randn(rows, CFG.hidden_size)


def test_code_logits_row_order_is_b_times_4_plus_q():
    e, hidden = embed_and_hidden(3, 3)
    with torch.no_grad():
        logits = e.code_logits(hidden)
    assert logits.shape == (3 * CFG.num_vq, CFG.num_audio_tokens)
    assert logits.dtype == torch.float32
    for b in range(3):
        for q in range(CFG.num_vq):
            expected = e.head_code[q] @ hidden[b]
            torch.testing.assert_close(logits[b * CFG.num_vq + q], expected, rtol=1e-5, atol=1e-5)


def test_text_logits():
    e = make_embed(5)
    hidden = torch.randn(2, CFG.hidden_size)
    with torch.no_grad():
        logits = e.text_logits(hidden)
    assert logits.shape == (2, CFG.num_text_tokens)
    torch.testing.assert_close(logits, hidden @ e.head_text.T, rtol=1e-5, atol=1e-5)


def test_embed_prompt_reads_nothing_back_from_the_device():
    e = make_embed(5)
    ids = torch.randint(0, CFG.num_audio_tokens, (1, 6, CFG.num_vq))
    text_mask = torch.tensor([[True, True, True, False, False, False]])
    with torch.no_grad():
        out, syncs = host_syncs(lambda: e.embed_prompt(ids, text_mask))
    assert not syncs, syncs
    assert torch.equal(out[0, 0], e.emb_text.weight[ids[0, 0, 0]])


BF16_PACKING = packing_available(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not BF16_PACKING, reason="oneDNN packs no bf16 weights on this CPU")
def test_bf16_code_heads_keep_the_row_order_and_each_rows_bits():
    e, hidden = embed_and_hidden(5, 5)
    with torch.no_grad():
        exact = e.code_logits(hidden)
        e.pack_heads(code_dtype=torch.bfloat16)
        assert e.heads_packed and e.code_heads_dtype == torch.bfloat16
        logits = e.code_logits(hidden)
        alone = [e.code_logits(hidden[b : b + 1]) for b in range(5)]
    assert logits.shape == exact.shape and logits.dtype == torch.float32
    # bf16 weights and inputs: within bf16's rounding of the fp32 logits, row b * num_vq + q as before
    torch.testing.assert_close(logits, exact, rtol=0.03, atol=0.05)
    assert not torch.equal(logits, exact)
    for b in range(5):  # a row's logits do not depend on the rows beside it (the engine's batch invariance)
        assert torch.equal(alone[b], logits[b * CFG.num_vq : (b + 1) * CFG.num_vq])


def test_code_heads_pack_in_fp32_or_bf16_only():
    e = make_embed(0)
    assert e.code_heads_dtype == torch.float32
    with pytest.raises(ValueError, match="fp32 or bf16"):
        e.pack_heads(code_dtype=torch.float16)
