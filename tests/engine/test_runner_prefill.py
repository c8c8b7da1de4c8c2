"""engine/runner.py's batched prefill (torch precisions): the prompts admitted in one step go through
the trunk in one call (``models.chattts.prefill``), each with its speaker embedding and voice-sample codes, and
every sequence gets what its prefill alone gives it; calls hold at most ``max_prefill_tokens``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_serve.engine import prefill_runner as prefill_runner_module
from chattts_serve.engine.config import EngineConfig
from chattts_serve.engine.outputs import SchedulerOutput
from chattts_serve.engine.plan import resolve_plan
from chattts_serve.engine.request import Sequence
from chattts_serve.engine.runner import ModelRunner, SeqInputs, StepSampling
from chattts_serve.models.chattts.prefill import prefill_prompts
from chattts_serve.sampling_params import SamplingParams
from tests.support.host_syncs import host_syncs
from tests.support.tiny_model import prepared

SPK_ID = 7  # the [spk_emb] token of these prompts
TEXT_EOS = 3
MAX_LEN = 96


def _model(tiny_ckpt, precision: str, slots: int, compile: bool = False):
    return prepared(tiny_ckpt, precision, slots, compile=compile)


def _sequences(model, slots: list[int]) -> list[Sequence]:
    """Mixed prompts: with and without a speaker, with voice-sample codes, one refine (text) pass."""
    cfg = model.config.gpt
    gen = torch.Generator().manual_seed(3)

    def ids(n: int, speaker: bool) -> list[int]:
        out = torch.randint(10, cfg.num_text_tokens, (n,), generator=gen).tolist()
        if speaker:
            out[1] = SPK_ID
        return out

    def speaker() -> torch.Tensor:
        v = torch.randn(cfg.hidden_size, generator=gen)
        return v / v.norm()

    codes = torch.randint(0, cfg.num_audio_tokens - 1, (11, cfg.num_vq), generator=gen)
    sampling = StepSampling((0.3,), 0.7, 20, 1.05, seed=5)
    inputs = [
        ("code", SeqInputs(ids(14, True), sampling, speaker(), SPK_ID)),
        ("code", SeqInputs(ids(31, False), sampling)),
        ("code", SeqInputs(ids(9, True), sampling, speaker(), SPK_ID, prompt_codes=codes)),  # voice sample
        ("text", SeqInputs(ids(22, True), StepSampling((0.7,), 0.7, 20, 1.0, seed=6), speaker(), SPK_ID)),
        ("code", SeqInputs(ids(3, False), sampling)),  # shorter than pad_rows_to
    ]
    seqs = []
    for slot, (kind, inp) in zip(slots, inputs, strict=True):
        n = len(inp.ids) + (0 if inp.prompt_codes is None else len(inp.prompt_codes))
        eos = 625 if kind == "code" else TEXT_EOS
        seq = Sequence("r", kind, n, 0, 8, eos, seeded=True, retry_empty=False, payload=inp)
        seq.slot = slot
        seqs.append(seq)
    return seqs


def _runner(model, layout, slots: int, max_prefill_tokens: int = 2048) -> ModelRunner:
    plan = resolve_plan(EngineConfig(precision=layout.precision.name), "cpu")
    runner = ModelRunner(model, layout, slots, MAX_LEN, TEXT_EOS, plan, max_prefill_tokens)
    runner.cache.k.fill_(7.0), runner.cache.v.fill_(7.0)  # what the slots held before
    return runner


SLOTS = [5, 0, 3, 1, 2]
MODES = [("fp32", False), ("fp32", True), ("bf16", False), ("int8", False), ("int8-static", False)]


@pytest.mark.parametrize("precision,compile", MODES)
def test_prompts_admitted_together_equal_each_alone(tiny_ckpt, precision, compile):
    """Hidden states, cache slots, first tokens and hidden of every sequence: bit-identical whether it
    is prefilled with the others or alone (fp32 packed or on padded rows, bf16, int8 weights and
    int8-static are batch-invariant per row; see models/chattts/prepare.py)."""
    model, layout = _model(tiny_ckpt, precision, 6, compile)
    together = _runner(model, layout, 6)
    seqs = _sequences(model, SLOTS)
    with torch.inference_mode():
        trunk = together.prefiller.trunk_outputs(seqs)
    batch = _sequences(model, SLOTS)  # the same prompts again, through the whole prefill step
    out = together.execute(SchedulerOutput(prefill=batch))
    for i, seq in enumerate(seqs):
        alone = _runner(model, layout, 6)
        with torch.inference_mode():
            [h] = alone.prefiller.trunk_outputs([seq]).values()
        assert torch.equal(trunk[seq.seq_id], h), (precision, seq.prompt_len)
        n, slot = seq.prompt_len, seq.slot
        for kv, kv_alone in ((together.cache.k, alone.cache.k), (together.cache.v, alone.cache.v)):
            assert torch.equal(kv[:, slot, :, :n], kv_alone[:, slot, :, :n])
            assert (kv[:, slot, :, n:] == 7.0).all()
        [single] = _sequences(model, SLOTS)[i : i + 1]
        got = _runner(model, layout, 6).execute(SchedulerOutput(prefill=[single]))
        assert out.tokens[batch[i].seq_id] == got.tokens[single.seq_id]
        if seq.kind == "code":
            assert torch.equal(out.hidden_of(batch[i].seq_id), got.hidden_of(single.seq_id))


def test_int8_dynamic_prompts_together_stay_close_to_alone(tiny_ckpt):
    """int8-dynamic quantises a call's activations with one scale (documented: not batch-invariant):
    batched, a prompt's hidden states move by about the mode's own error, never far."""
    model, layout = _model(tiny_ckpt, "int8-dynamic", 6)
    seqs = _sequences(model, SLOTS)
    with torch.inference_mode():
        trunk = _runner(model, layout, 6).prefiller.trunk_outputs(seqs)
        for seq in seqs:
            [h] = _runner(model, layout, 6).prefiller.trunk_outputs([seq]).values()
            rel = float((trunk[seq.seq_id] - h).norm() / h.norm())
            assert rel < 0.1, (seq.prompt_len, rel)


def test_prompt_embedding_places_speaker_text_and_codes(tiny_ckpt):
    model, layout = _model(tiny_ckpt, "fp32", 6)
    runner, embed = _runner(model, layout, 6), model.embed
    seqs = _sequences(model, SLOTS)
    with torch.inference_mode():
        emb, syncs = host_syncs(lambda: runner.prefiller.embed_prompts(seqs))
        assert not syncs, syncs
        assert emb.shape == (sum(s.prompt_len for s in seqs), model.config.gpt.hidden_size)
        start = 0
        for seq in seqs:
            inp: SeqInputs = seq.payload
            rows = emb[start : start + seq.prompt_len]
            for i, t in enumerate(inp.ids):
                want = inp.speaker if (t == SPK_ID and inp.speaker is not None) else embed.emb_text.weight[t]
                assert torch.equal(rows[i], want), (seq.prompt_len, i)
            if inp.prompt_codes is not None:
                assert torch.equal(rows[len(inp.ids) :], embed.embed_codes(inp.prompt_codes))
            assert torch.equal(runner.prefiller.embed_prompts([seq]), rows)  # alone: the same rows
            start += seq.prompt_len


def test_prefill_calls_hold_at_most_max_prefill_tokens(tiny_ckpt, monkeypatch):
    model, layout = _model(tiny_ckpt, "fp32", 6)
    seqs = _sequences(model, SLOTS)
    lengths = [s.prompt_len for s in seqs]  # 14, 31, 20, 22, 3
    with torch.inference_mode():
        whole = _runner(model, layout, 6).prefiller.trunk_outputs(seqs)
    calls: list[list[int]] = []

    def counting(gpt, emb, cache, slots, lens, pad_rows_to=1, starts=None, block=0, out_rows=None):
        calls.append(list(lens))
        return prefill_prompts(gpt, emb, cache, slots, lens, pad_rows_to, starts, block, out_rows)

    monkeypatch.setattr(prefill_runner_module, "prefill_prompts", counting)
    runner = _runner(model, layout, 6, max_prefill_tokens=45)
    with torch.inference_mode():
        chunked, syncs = host_syncs(lambda: runner.prefiller.trunk_outputs(seqs))
    assert calls == [lengths[:2], lengths[2:]] and all(sum(c) <= 45 for c in calls)
    assert not syncs, syncs  # the trunk call reads nothing back either
    assert all(torch.equal(whole[s.seq_id], chunked[s.seq_id]) for s in seqs)
    calls.clear()
    with torch.inference_mode():  # a prompt longer than the budget still goes, alone and whole
        _runner(model, layout, 6, max_prefill_tokens=10).prefiller.trunk_outputs(seqs[:2])
    assert calls == [[14], [31]]
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        _runner(model, layout, 6, max_prefill_tokens=0)


def test_engine_requests_admitted_together_equal_each_alone(tiny_engine, monkeypatch):
    """Batch invariance through the engine, speakers and voice samples included: the requests are
    prefilled in one trunk call and each gets the codes it gets alone."""
    speakers = [tiny_engine.sample_speaker(seed=s) for s in (1, 2, 3)]
    [voice] = tiny_engine.synthesize("你好。", SamplingParams(seed=1, min_new_tokens=8, max_new_tokens=8))
    sample = tiny_engine.speaker_from_audio(voice.audio)
    texts = ["你好，世界。", "今天天气很好，我们去公园散步吧。", "一二三。", "Good morning."]
    base = dict(min_new_tokens=6, max_new_tokens=12, refine_text=False)
    params = [
        SamplingParams(seed=5, speaker=speakers[0], **base),
        SamplingParams(seed=6, speaker=speakers[1], speaker_sample=sample, speaker_sample_text="你好。", **base),
        SamplingParams(seed=7, **base),
        SamplingParams(seed=8, speaker=speakers[2], **base),
    ]
    calls: list[int] = []

    def counting(gpt, emb, cache, slots, lens, pad_rows_to=1, starts=None, block=0, out_rows=None):
        calls.append(len(lens))
        return prefill_prompts(gpt, emb, cache, slots, lens, pad_rows_to, starts, block, out_rows)

    monkeypatch.setattr(prefill_runner_module, "prefill_prompts", counting)
    together = tiny_engine.synthesize(texts, params)
    assert calls[0] == len(texts), calls  # one call for the four prompts
    for text, p, got in zip(texts, params, together, strict=True):
        [alone] = tiny_engine.synthesize(text, p)
        assert got.codes.shape[0] >= 6
        np.testing.assert_array_equal(got.codes, alone.codes)
