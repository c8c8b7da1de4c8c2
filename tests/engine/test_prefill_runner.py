"""engine/prefill_runner.py's heads: a step's prompts of one kind through the heads in one call on
their last rows where the heads are oneDNN-packed (the same bits as the reference's all-positions
matmul, kept as is in the reference-exact one-slot layout)."""

from __future__ import annotations

import pytest
import torch

from chattts_serve.engine.prefill_runner import whole
from chattts_serve.kernels import decode_attention, int4_gemv

from .test_runner_prefill import SLOTS, _model, _runner, _sequences


def _per_prompt_heads(model, trunk: dict, seqs) -> dict[str, torch.Tensor]:
    """What the runner computed before: every position of each prompt through the heads, the last kept."""
    embed, q = model.embed, model.config.gpt.num_vq
    out: dict[str, list] = {"code": [], "text": []}
    for s in seqs:
        h = trunk[s.seq_id]
        out[s.kind].append(embed.code_logits(h)[-q:] if s.kind == "code" else embed.text_logits(h)[-1:])
    return {k: torch.cat(v) for k, v in out.items() if v}


INT4 = pytest.param(
    "int4",
    marks=pytest.mark.skipif(
        not (int4_gemv.cpu_supported() and decode_attention.cpu_supported()), reason="the C++ int4 step needs VNNI"
    ),
)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", INT4])
def test_last_row_heads_are_bit_identical_to_all_positions(tiny_ckpt, precision):
    """Also the trunk: ``run`` asks for each prompt's last row only (int4's step then runs its last layer past
    the cache writes on those rows alone), and gets the rows and cache of every position's run."""
    model, layout = _model(tiny_ckpt, precision, 6)
    runner, every = _runner(model, layout, 6), _runner(model, layout, 6)
    assert runner.prefiller.last_rows_heads  # packed heads on this CPU layout
    seqs = _sequences(model, SLOTS)
    with torch.inference_mode():
        trunk = every.prefiller.trunk_outputs(seqs)
        got = runner.prefiller.run(whole(seqs))
    for name, buf in every.cache.named_buffers():  # keys, values (and an int8 cache's scales) of every position
        for s in seqs:
            written = (slice(None), s.slot, slice(None), slice(None, s.prompt_len))
            assert torch.equal(getattr(runner.cache, name)[written], buf[written]), name
    want = _per_prompt_heads(model, trunk, seqs)
    assert set(got) == set(want) == {"code", "text"}
    for kind, p in got.items():
        assert [s.kind for s in p.seqs] == [kind] * len(p.seqs)
        assert torch.equal(p.logits, want[kind]), kind
        assert torch.equal(p.last, torch.stack([trunk[s.seq_id][-1] for s in p.seqs]))


def test_one_slot_keeps_the_reference_matmul(tiny_ckpt):
    """One slot, plain fp32: F.linear on every prompt position, as chattts (the fidelity goldens)."""
    model, layout = _model(tiny_ckpt, "fp32", 1)
    runner = _runner(model, layout, 1)
    assert not runner.prefiller.last_rows_heads
    [seq] = _sequences(model, [0, 1, 2, 3, 4])[1:2]
    seq.slot = 0
    with torch.inference_mode():
        trunk = runner.prefiller.trunk_outputs([seq])
        got = runner.prefiller.run(whole([seq]))
    assert torch.equal(got["code"].logits, _per_prompt_heads(model, trunk, [seq])["code"])
