"""Run the fidelity cases through our engine and compare with the reference's recorded outputs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from chattts_serve import Engine, RefineParams, SamplingParams
from chattts_serve.audio.decode import codes_to_mel, hidden_to_mel, mel_to_wav
from chattts_serve.engine.config import EngineConfig
from chattts_serve.models.chattts.speaker import (
    SpeakerStats,
    default_speaker_stats,
    encode_prompt_codes,
    encode_speaker,
)

TOL = 1e-4
# An encoder code may differ from the reference's only where the value it rounds lies this close to a
# rounding boundary (in units of one quantiser level). The encoder's test waveform is well-conditioned:
# a 1e-6 relative perturbation of it moves those values by < 1e-4 (test_golden.py checks), ten times
# less than this bound, which excuses only ~0.2 % of codes by chance.
ENCODER_TIE = 1e-3


def params_for(case: dict) -> SamplingParams:
    temp = case.get("temperature", 0.3)
    return SamplingParams(
        seed=case["seed"],
        speaker=case.get("speaker"),
        temperature=tuple(temp) if isinstance(temp, list) else temp,
        top_p=case.get("top_p", 0.7),
        top_k=case.get("top_k", 20),
        repetition_penalty=case.get("repetition_penalty", 1.05),
        min_new_tokens=case.get("min_new_tokens", 0),
        max_new_tokens=case.get("max_new_tokens", 2048),
        prompt=case.get("prompt", "[speed_5]"),
        refine_text=not case.get("skip_refine", True),
        refine=RefineParams(
            max_new_tokens=case.get("refine_max_new_tokens", 384),
            prompt=case.get("refine_prompt", ""),
            seed=case.get("refine_seed"),
        ),
        speaker_sample=case.get("speaker_sample"),
        speaker_sample_text=case.get("speaker_sample_text", ""),
        do_text_normalization=case.get("normalize", True),
        split_text=case.get("split", False),
    )


def _maxdiff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    return float(np.abs(a - b).max()) if a.size else 0.0


def _compare_split(i: int, result, captured: list, ref: dict, note) -> None:
    """A split text: the voice step (piece 0 alone), its voice sample, then every piece with it."""
    code_outs = [o for o in captured if o.seq.kind == "code" and o.token is not None]
    voice_ref = ref[f"{i}/voice_codes"]
    voice = np.array([o.token for o in code_outs[: len(voice_ref)]], dtype=np.int64)
    assert np.array_equal(voice, voice_ref), f"case {i}: voice-step codes differ"
    assert result.voice_sample == str(ref[f"{i}/voice_sample"]), f"case {i}: voice sample differs"
    assert result.text[0] == str(ref[f"{i}/voice_text"]), f"case {i}: voice sample transcript"
    assert len(result.text) == int(ref[f"{i}/pieces"]), f"case {i}: {len(result.text)} pieces"
    ref_codes = ref[f"{i}/codes"]
    assert result.codes.shape == ref_codes.shape, f"case {i}: {result.codes.shape} vs {ref_codes.shape}"
    mismatch = np.nonzero((result.codes != ref_codes).any(1))[0]
    assert mismatch.size == 0, f"case {i}: codes differ first at step {mismatch[:1]}"
    # Pieces run one after another here (one slot), so their hidden states come in piece order.
    hiddens = torch.stack([o.hidden for o in code_outs[len(voice_ref) :]])
    note("hidden_states", _maxdiff(hiddens.numpy(), ref[f"{i}/hiddens"]))
    note("end_to_end_wav", _maxdiff(result.audio, ref[f"{i}/wav"]))


def compare_all(ckpt: Path, cases: list[dict], ref: dict[str, np.ndarray]) -> dict:
    """Asserts fidelity for every case; returns the measured maximum differences.

    The engine runs with one KV slot: every matmul then sees exactly the rows of a batch-1 reference
    run, which is what makes fp32 bit-identical (see ``ModelLayout.pad_rows_to``)."""
    engine = Engine.from_pretrained(ckpt, device="cpu", config=EngineConfig.with_slots(1))
    model = engine.model
    captured: list = []
    update = engine.core.stage.pipeline.update

    def recording_update(outputs, hidden=None):
        for o in outputs:  # each output with its own hidden state (the step's tensor is shared)
            h = hidden[o.hidden_row].clone() if o.hidden_row is not None else None
            captured.append(SimpleNamespace(seq=o.seq, token=o.token, hidden=h))
        return update(outputs, hidden)

    engine.core.stage.pipeline.update = recording_update
    report = {"cases": 0, "steps_compared": 0, "long_cases": 0, "eos_cases": 0, "max_abs": {}}
    worst = report["max_abs"]

    def note(key: str, value: float) -> None:
        worst[key] = max(worst.get(key, 0.0), value)
        assert value <= TOL, f"{key}: max abs diff {value} > {TOL}"

    for i, case in enumerate(cases):
        captured.clear()
        [result] = engine.synthesize(case["text"], params_for(case))
        if case.get("split"):
            _compare_split(i, result, captured, ref, note)
            report["steps_compared"] += len(result.codes) + len(ref[f"{i}/voice_codes"])
            report["split_cases"] = report.get("split_cases", 0) + 1
            report["cases"] += 1
            continue
        ref_codes = ref[f"{i}/codes"]
        assert result.codes.shape == ref_codes.shape, f"case {i}: {result.codes.shape} vs {ref_codes.shape}"
        mismatch = np.nonzero((result.codes != ref_codes).any(1))[0]
        assert mismatch.size == 0, f"case {i}: codes differ first at step {mismatch[:1]}"
        report["steps_compared"] += len(ref_codes)
        report["long_cases"] += len(ref_codes) >= 100
        report["eos_cases"] += result.finish_reasons == ["stop"]
        if f"{i}/refine_ids" in ref:
            ids = [o.token[0] for o in captured if o.seq.kind == "text" and o.token is not None]
            assert np.array_equal(np.array(ids, dtype=np.int64), ref[f"{i}/refine_ids"]), f"case {i}: refine ids"
            assert result.text[0] == str(ref[f"{i}/refined_text"]), f"case {i}: refined text"
        hiddens = torch.stack([o.hidden for o in captured if o.seq.kind == "code" and o.token is not None])
        note("hidden_states", _maxdiff(hiddens.numpy(), ref[f"{i}/hiddens"]))
        # Decoder and Vocos on the reference's own hidden states and mel.
        ref_h = torch.from_numpy(ref[f"{i}/hiddens"])
        note("decoder_mel", _maxdiff(hidden_to_mel(model, ref_h).numpy(), ref[f"{i}/mel"]))
        note("vocos_wav", _maxdiff(mel_to_wav(model, torch.from_numpy(ref[f"{i}/mel"])).numpy(), ref[f"{i}/wav"]))
        note("dvae_mel", _maxdiff(codes_to_mel(model, torch.from_numpy(ref_codes)).numpy(), ref[f"{i}/dvae_mel"]))
        note("end_to_end_wav", _maxdiff(result.audio, ref[f"{i}/wav"]))
        report["cases"] += 1

    wav = ref["encoder/wav"]
    with torch.inference_mode():
        codes, margin = model.dvae.encode_with_margin(torch.from_numpy(wav))
    report["encoder_ties"] = encoder_ties(codes.numpy(), margin.numpy(), ref["encoder/codes"], model.dvae)
    # Our prompt-codes string of the reference's codes is the reference's; of our own codes, ours.
    assert encode_prompt_codes(ref["encoder/codes"]) == str(ref["encoder/string"])
    assert engine.speaker_from_audio(wav) == encode_prompt_codes(codes)
    spk_stat = ckpt / "asset/spk_stat.txt"
    stats = SpeakerStats.from_string(spk_stat.read_text().strip()) if spk_stat.is_file() else default_speaker_stats()
    for s in (0, 1, 2):
        torch.manual_seed(s)
        assert encode_speaker(stats.sample()) == str(ref[f"speaker/{s}"]), f"random speaker, seed {s}"
        assert engine.sample_speaker(seed=s) == str(ref[f"speaker/{s}"])
    return report


def encoder_ties(codes: np.ndarray, margin: np.ndarray, ref: np.ndarray, dvae) -> int:
    """Asserts our DVAE encoder codes [G*R, T] are the reference's but for near-ties; returns how many
    (group, frame) pairs differ on a tie.

    The residual quantiser rounds level r of group g from what levels < r left over, so the first
    level that differs decides: if it rounded within ``ENCODER_TIE`` of a boundary here, it and the
    later levels of that group and frame are excused; anything else is a real difference."""
    residuals = dvae.vq_layer.quantizer.residuals
    assert codes.shape == ref.shape, f"encoder codes {codes.shape} vs {ref.shape}"
    ties = 0
    for row, t in np.argwhere(codes != ref):
        first = row - row % residuals
        level = first + int(np.argmax(codes[first : first + residuals, t] != ref[first : first + residuals, t]))
        if level != row:
            continue  # the group's first differing level already judged this frame
        assert margin[row, t] < ENCODER_TIE, (
            f"DVAE encoder code {row} at frame {t} differs ({codes[row, t]} vs {ref[row, t]}) "
            f"with rounding margin {margin[row, t]:.2e} >= {ENCODER_TIE}: not a near-tie"
        )
        ties += 1
    assert ties <= max(2, codes.size // 100), f"{ties} encoder near-ties: too many to be float noise"
    return ties
