"""Run the reference ChatTTS (PyPI chattts==0.2.5) on a checkpoint and record what it produces.

Runs in the reference environment only (build it with ``bash ../shared/oracle/setup_venv.sh DIR``):

    DIR/bin/python scripts/reference_oracle.py CHECKPOINT_DIR CASES.json OUT.npz

CASES.json is a list of cases (see ``tests/fidelity/cases.py``); for each, the reference's public
``Chat.infer`` runs, and hooks record the refine ids and text, the audio codes, the GPT hidden states,
the Decoder mel and the Vocos waveform before the reference's |x| <= 1e-5 sample filter. The DVAE
(codes -> mel) and its encoder (speaker from audio) are recorded as well. Results go into one npz.

A case with ``"split": true`` runs ``split_text=True, max_split_batch=1`` (one piece per GPT call, the
batch-1 setting our batch-invariant engine matches): the reference first speaks piece 0 alone (the
voice step), encodes that audio into ``spk_smp`` with piece 0 as ``txt_smp``, then speaks every piece.
Recorded: the voice step's codes, the sample and its transcript, and the pieces' codes, hidden states
and waveforms, concatenated in order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ChatTTS  # noqa: E402  (reference env only)
import numpy as np
import torch

# Appended, not prepended: that folder has modules (profile.py, eval.py) that would shadow others.
sys.path.append(str(Path(__file__).resolve().parents[1] / "src" / "chattts_serve" / "bench"))
from reference_driver import _sha256, load_reference  # noqa: E402  (a standalone file: no chattts_serve import)


def run_case(chat: ChatTTS.Chat, case: dict) -> dict[str, np.ndarray]:
    rec: dict[str, list] = {"ids": [], "hiddens": [], "mel": [], "wav": [], "refine_ids": []}
    orig_infer_code, orig_refine, orig_vocos = chat._infer_code, chat._refine_text, chat._vocos_decode

    def infer_code(*a, **k):
        for r in orig_infer_code(*a, **k):
            rec["ids"].append([x.clone() for x in r.ids])
            rec["hiddens"].append([h.clone() for h in r.hiddens])
            yield r

    def refine(*a, **k):
        r = orig_refine(*a, **k)
        rec["refine_ids"].append([x.clone() for x in r.ids])
        return r

    def vocos_decode(spec):
        rec["mel"].append(spec.clone())
        wav = orig_vocos(spec)
        rec["wav"].append(wav.copy())
        return wav

    chat._infer_code, chat._refine_text, chat._vocos_decode = infer_code, refine, vocos_decode
    try:
        code_p = chat.InferCodeParams(
            spk_emb=case.get("speaker"),
            manual_seed=case["seed"],
            temperature=case.get("temperature", 0.3),
            top_P=case.get("top_p", 0.7),
            top_K=case.get("top_k", 20),
            repetition_penalty=case.get("repetition_penalty", 1.05),
            min_new_token=case.get("min_new_tokens", 0),
            max_new_token=case.get("max_new_tokens", 2048),
            prompt=case.get("prompt", "[speed_5]"),
            spk_smp=case.get("speaker_sample"),
            txt_smp=case.get("speaker_sample_text") or None,
            show_tqdm=False,
        )
        refine_p = chat.RefineTextParams(
            manual_seed=case.get("refine_seed", case["seed"]),
            max_new_token=case.get("refine_max_new_tokens", 384),
            prompt=case.get("refine_prompt", ""),
            show_tqdm=False,
        )
        if case.get("split"):
            chat.infer(
                case["text"],
                skip_refine_text=True,
                params_infer_code=code_p,
                do_text_normalization=case.get("normalize", True),
                split_text=True,
                max_split_batch=1,
            )
            return _split_outputs(rec, code_p)
        text_out = None
        if not case.get("skip_refine", True):
            text_out = chat.infer(
                case["text"],
                skip_refine_text=False,
                refine_text_only=True,
                params_refine_text=refine_p,
                do_text_normalization=case.get("normalize", True),
                split_text=False,
            )
            rec["refine_ids"].clear()
        chat.infer(
            case["text"],
            skip_refine_text=case.get("skip_refine", True),
            params_refine_text=refine_p,
            params_infer_code=code_p,
            do_text_normalization=case.get("normalize", True),
            split_text=False,
        )
    finally:
        chat._infer_code, chat._refine_text, chat._vocos_decode = orig_infer_code, orig_refine, orig_vocos
    out = {
        "codes": rec["ids"][-1][0].numpy().astype(np.int64),
        "hiddens": rec["hiddens"][-1][0].numpy().astype(np.float32),
        "mel": rec["mel"][-1][0].numpy().astype(np.float32),
        "wav": rec["wav"][-1][0].astype(np.float32),
    }
    if rec["refine_ids"]:
        out["refine_ids"] = rec["refine_ids"][-1][0].numpy().astype(np.int64)
        out["refined_text"] = np.array(text_out if isinstance(text_out, str) else text_out[0])
    # Codes -> mel through the DVAE (use_decoder=False path), on the same codes.
    with torch.inference_mode():
        codes = torch.from_numpy(out["codes"]).t()[None].to(torch.int32)
        out["dvae_mel"] = chat.dvae(codes.clone()).numpy()[0].astype(np.float32)
    return out


def _split_outputs(rec: dict[str, list], code_p) -> dict[str, np.ndarray]:
    assert len(rec["ids"]) >= 3 and code_p.spk_smp is not None, "want a voice step and >= 2 pieces"
    pieces = range(1, len(rec["ids"]))  # call 0 is the voice step
    return {
        "pieces": np.array(len(pieces)),
        "voice_codes": rec["ids"][0][0].numpy().astype(np.int64),
        "voice_sample": np.array(code_p.spk_smp),
        "voice_text": np.array(code_p.txt_smp),
        "codes": np.concatenate([rec["ids"][k][0].numpy() for k in pieces]).astype(np.int64),
        "hiddens": np.concatenate([rec["hiddens"][k][0].numpy() for k in pieces]).astype(np.float32),
        "wav": np.concatenate([rec["wav"][k][0] for k in pieces]).astype(np.float32),
    }


def main() -> None:
    ckpt, cases_path, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    cases = json.loads(cases_path.read_text())
    chat = load_reference(ckpt)
    result: dict[str, np.ndarray] = {}
    for i, case in enumerate(cases):
        for k, v in run_case(chat, case).items():
            result[f"{i}/{k}"] = v
    # Speaker from audio (DVAE encoder): a deterministic test waveform, a tone over broadband noise.
    # Every mel bin then holds energy far above float noise: a pure tone leaves bins at the log floor,
    # where a 1e-7 change of the samples moved log-mel by 0.4 and flipped codes between CPUs.
    t = np.arange(24000 * 2) / 24000.0
    tone = 0.2 * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 1.5 * t))
    wav = (tone + 0.05 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)
    result["encoder/wav"] = wav
    result["encoder/codes"] = chat.dvae.sample_audio(wav).numpy().astype(np.int64)
    result["encoder/string"] = np.array(chat.sample_audio_speaker(wav))
    # Random speakers from the checkpoint's statistics under fixed global seeds.
    for s in (0, 1, 2):
        torch.manual_seed(s)
        result[f"speaker/{s}"] = np.array(chat.sample_random_speaker())
    result["meta/files"] = np.array(
        json.dumps({str(p.relative_to(ckpt)): _sha256(p) for p in sorted(ckpt.rglob("*")) if p.is_file()})
    )
    result["meta/versions"] = np.array(
        json.dumps({"chattts": "0.2.5", "torch": torch.__version__, "numpy": np.__version__})
    )
    np.savez_compressed(out_path, **result)
    print(f"wrote {len(cases)} cases to {out_path}")


if __name__ == "__main__":
    main()
