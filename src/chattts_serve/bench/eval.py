"""``chattts-serve eval``: what each speed mode costs in quality, measured against fp32 on the same
checkpoint and texts (the README's quality table comes from here).

For every text, fp32 first generates audio codes (fixed length, refine off, one seed). Then per mode:

* teacher-forced: the mode's GPT reads the same prompt + fp32 codes in one pass; per position and
  codebook we compare its next-code distribution with fp32's: top-1 agreement and KL(fp32 || mode);
* free-run: the mode generates on its own with the same seed; the share of steps whose 4 codes equal
  fp32's, and the first step where they differ (sampling amplifies any difference after that);
* same codes, decoded: the Decoder turns each model's teacher-forced hidden states into a mel (Decoder
  and Vocos run in fp32 in every mode), then Vocos into audio; mel distance (mean |log-mel diff|) and
  waveform SNR in dB vs fp32.

``--audio-dtypes``: the audio stage's own cost, apart from the trunk's: fp32's teacher-forced hidden states
decoded by each ``--audio-dtype`` (``audio.decode``), waveform SNR vs fp32's audio. Code agreement is 1 by
construction (the audio stage reads the trunk's hidden states and never feeds back into it).

``ort-auto`` is measured as eval runs every mode, one sequence at a time: each prompt is one call as
wide as its tokens (int8 whenever the prompt reaches the crossover), each code step one row (4-bit
below a crossover of 2 or more). Its row is that mix, what one stream gets; at or above the crossover
every call is int8, which is the ``ort-int8`` row. ``ort_auto_int4_share`` says which share of the
trunk calls of its teacher-forced and free runs went to the 4-bit session.

With random weights the numbers measure numerical fidelity, not perceived quality.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import replace
from typing import Any

from ..engine.config import KV_CACHE_DTYPES
from ..kernels.precisions import PRECISIONS
from . import stats
from .common import TEXTS, run_tool, set_threads
from .stats import snr_db as _snr_db

KV_SUFFIX = "/kv-"
"""``PRECISION/kv-bf16``, ``PRECISION/kv-int8``: that precision with a bf16 or int8 KV cache
(``RunnerConfig.kv_cache_dtype``)."""
KV_DTYPES = tuple(d for d in KV_CACHE_DTYPES if d != "auto")
# Every precision a CPU runs, against fp32 (fp16 is CUDA-only), and each KV cache dtype under two of them.
DEFAULT_MODES = (
    *(p for p in PRECISIONS if p not in ("fp32", "fp16")),
    *(f"{p}{KV_SUFFIX}{kv}" for kv in KV_DTYPES for p in ("fp32", "int8-static")),
)


def split_mode(mode: str) -> tuple[str, str]:
    """``"int8-static/kv-bf16"`` -> ("int8-static", "bf16"); a plain precision -> (precision, "auto")."""
    precision, sep, kv = mode.partition(KV_SUFFIX)
    if sep and kv not in KV_DTYPES:
        raise ValueError(f"mode {mode!r}: the KV cache suffix must be {' or '.join(KV_SUFFIX + d for d in KV_DTYPES)}")
    return precision, kv or "auto"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, from {', '.join(PRECISIONS[1:])}, each optionally with {KV_SUFFIX}bf16 or "
        f"{KV_SUFFIX}int8 (a bf16 or int8 KV cache) (default: those the device runs)",
    )
    p.add_argument("--steps", type=int, default=100, help="audio tokens per text")
    p.add_argument("--num-texts", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--onnx-cache-dir",
        default=None,
        help="where the ort-* modes cache their ONNX exports (default: the user cache directory)",
    )
    p.add_argument(
        "--ort-auto-crossover",
        type=int,
        default=0,
        help="ort-auto: trunk calls of this many rows or more run int8 (0: from a table by CPU); eval's code "
        "steps are one row, so 1 measures ort-auto's int8 path",
    )
    p.add_argument("--plot", default=None, help="PNG: agreement and SNR per mode")
    p.add_argument(
        "--audio-dtypes",
        default="",
        help="comma-separated --audio-dtype values (e.g. bf16,ov-bf16,ov-int8) to measure on fp32's hidden states: "
        "the waveform's SNR against fp32's audio (the codes are fp32's: the audio stage never feeds the trunk)",
    )


def _prompt_ids(engine, text: str) -> list[int]:
    from ..models.chattts.tokenizer import code_prompt

    return engine.tokenizer.encode(code_prompt(text, "[speed_5]", has_speaker=False))


def teacher_forced(engine, ids: list[int], codes) -> tuple[Any, Any]:
    """The GPT over prompt + codes: (hidden [T, H] that produced each code, logits [T, 4, V]). Torch
    modes read it in one pass; ONNX Runtime modes (``ort-*``) as the engine runs them, the prompt in one
    call, then one code per step (their int8 activation scale depends on the rows of a call); so do
    modes with a bf16 or int8 KV cache (decode attention reads the cache's keys through its own kernel)."""
    import torch

    model = engine.model
    dev = engine.device
    n, t = len(ids), codes.shape[0]
    full = torch.zeros(1, n + t, model.config.gpt.num_vq, dtype=torch.long)
    full[0, :n] = torch.tensor(ids)[:, None]
    full[0, n:] = torch.as_tensor(codes, dtype=torch.long)
    mask = torch.zeros(1, n + t, dtype=torch.bool)
    mask[0, :n] = True
    with torch.inference_mode():
        emb = model.embed.embed_prompt(full.to(dev), mask.to(dev))
        if engine.layout.trunk is not None:
            hs = _onnx_hidden(engine.layout.trunk, emb, n, t)
        elif engine.plan.kv_cache_dtype != model.gpt.norm.weight.dtype:
            hs = _stepwise_hidden(engine, emb, n, t)
        else:
            cache = model.gpt.new_cache(1, n + t)
            positions = torch.arange(n + t, device=dev)[None]
            slot = torch.zeros(1, dtype=torch.long, device=dev)
            dtype = model.gpt.norm.weight.dtype
            h = model.gpt(emb.to(dtype), positions, cache, slot, 0, None, last_only=False).float()[0]
            hs = h[n - 1 : n - 1 + t]
        logits = model.embed.code_logits(hs).view(t, model.config.gpt.num_vq, -1)
    return hs, logits


def _stepwise_hidden(engine, emb, n: int, t: int):
    """``_onnx_hidden`` for the torch trunk: the engine's prefill (``prefill_prompts``: int4 runs it on its C++ step),
    then ``GPT.decode`` steps, in the engine's cache dtype."""
    import torch

    from ..models.chattts.prefill import prefill_prompts

    gpt = engine.model.gpt
    dtype = gpt.norm.weight.dtype
    cache = gpt.new_cache(1, n + t, dtype=engine.plan.kv_cache_dtype)
    hs = [prefill_prompts(gpt, emb[0, :n].to(dtype), cache, [0], [n], engine.layout.pad_rows_to)[-1]]
    for pos in range(n, n + t - 1):
        hs.append(gpt.decode(emb[:, pos].to(dtype), cache, [0], [pos], engine.layout.pad_rows_to)[0])
    return torch.stack(hs).float()


def _onnx_hidden(trunk, emb, n: int, t: int):
    """Hidden states at positions n-1 .. n+t-2 of emb [1, n + t, H]: prefill, then single-token steps."""
    import numpy as np
    import torch

    cache = trunk.new_cache(1, n + t)
    one = np.ones(1, dtype=np.int32)
    hs = [trunk.run(emb[:, :n], cache, 0, one * (n - 1), one * n)[0, -1]]
    for pos in range(n, n + t - 1):
        hs.append(trunk.run(emb[:, pos : pos + 1], cache, 0, one * pos, one)[0, 0])
    return torch.stack(hs)


def _decode(engine, hidden):
    from ..audio.decode import hidden_to_mel, mel_to_wav

    mel = hidden_to_mel(engine.model, hidden)
    return mel, mel_to_wav(engine.model, mel)


def _free_run(engine, texts: list[str], steps: int, seed: int):
    from ..sampling_params import SamplingParams

    params = SamplingParams(seed=seed, min_new_tokens=steps, max_new_tokens=steps, refine_text=False)
    return [engine.synthesize([t], params)[0].codes for t in texts]  # one at a time: no batching effects


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from ..engine.config import EngineConfig, RunnerConfig
    from ..engine.engine import Engine
    from ..kernels.quant import check_supported, parse_precision

    set_threads(args)
    device = torch.device(args.device)
    if args.modes:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in modes:
            check_supported(parse_precision(split_mode(m)[0]), device)  # fail before any work
    else:
        modes = []
        for m in DEFAULT_MODES + ("fp16",):
            if split_mode(m)[1] == "int8" and device.type != "cpu":
                continue  # the int8 KV cache runs on the CPU only (``engine.plan``)
            try:
                check_supported(parse_precision(split_mode(m)[0]), device)
                modes.append(m)
            except ValueError:
                pass
    texts = [TEXTS[i % len(TEXTS)] for i in range(args.num_texts)]
    if args.steps < 2 or not texts:
        raise ValueError("--steps must be >= 2 and --num-texts >= 1")

    runner = RunnerConfig(onnx_cache_dir=args.onnx_cache_dir, ort_auto_crossover=args.ort_auto_crossover)
    ref = Engine.from_pretrained(args.model, device, EngineConfig.with_slots(1))
    codes = _free_run(ref, texts, args.steps, args.seed)
    ids = [_prompt_ids(ref, t) for t in texts]
    base, hiddens = [], []
    for i, c in zip(ids, codes, strict=True):
        h, lg = teacher_forced(ref, i, c)
        mel, wav = _decode(ref, h)
        base.append((lg.log_softmax(-1), mel, wav))
        hiddens.append(h)
    audio_rows = _audio_dtype_rows(ref.model, hiddens, [b[2] for b in base], args.audio_dtypes)
    del ref
    gc.collect()

    rows = []
    for mode in modes:
        precision, kv = split_mode(mode)
        config = EngineConfig.with_slots(1, precision=precision, runner=replace(runner, kv_cache_dtype=kv))
        eng = Engine.from_pretrained(args.model, device, config)
        auto = getattr(eng.layout.trunk, "calls", None)  # ort-auto: calls per session (a live count)
        auto_before = dict(auto) if auto is not None else None
        top1, kl, mel_d, snr = [], [], [], []
        for i, c, (lp32, mel32, wav32) in zip(ids, codes, base, strict=True):
            h, lg = teacher_forced(eng, i, c)
            lp = lg.log_softmax(-1)
            top1.append(float((lp.argmax(-1) == lp32.argmax(-1)).float().mean()))
            kl.append(float((lp32.exp() * (lp32 - lp)).sum(-1).mean()))
            mel, wav = _decode(eng, h)
            mel_d.append(float((mel - mel32).abs().mean()))
            snr.append(_snr_db(wav32, wav))
        free = _free_run(eng, texts, args.steps, args.seed)
        agree, first_diff = [], []
        for a, b in zip(codes, free, strict=True):
            n = min(len(a), len(b))
            same = (a[:n] == b[:n]).all(axis=1)
            agree.append(float(same.mean()) if n else 0.0)
            first_diff.append(int(np.argmin(same)) if not same.all() else n)
        row: dict[str, Any] = {}
        if auto is not None:
            small, large = (auto[k] - auto_before[k] for k in ("small", "large"))
            row["ort_auto_int4_share"] = round(small / max(1, small + large), 4)
        rows.append(
            {
                "precision": mode,
                "tf_top1_agreement": round(float(np.mean(top1)), 4),
                "tf_kl_nats": round(float(np.mean(kl)), 5),
                "free_run_code_agreement": round(float(np.mean(agree)), 4),
                "free_run_first_divergence_step": int(min(first_diff)),
                "mel_l1": round(float(np.mean(mel_d)), 5),
                "wav_snr_db": round(float(np.mean(snr)), 2),
                **row,
            }
        )
        del eng
        gc.collect()
    result = {
        "bench": "eval",
        "model": str(args.model),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "num_texts": len(texts),
        "seed": args.seed,
        "modes": rows,
        "audio_modes": audio_rows,
    }
    result["markdown"] = markdown_table(result)
    return result


def _audio_dtype_rows(model, hiddens: list, wavs: list, audio_dtypes: str) -> list[dict[str, Any]]:
    """Per ``--audio-dtype`` in ``audio_dtypes``: fp32's hidden states decoded by it, SNR against fp32's audio."""
    import numpy as np
    import torch

    from ..audio.decode import _decode_batch

    rows = []
    for dtype in [d.strip() for d in audio_dtypes.split(",") if d.strip()]:
        with torch.inference_mode():
            outs = [_decode_batch(model, h[None], dtype, None)[0] for h in hiddens]
        snr = [_snr_db(w, out) for w, out in zip(wavs, outs, strict=True)]
        rows.append(
            {
                "audio_dtype": dtype,
                "free_run_code_agreement": 1.0,
                "wav_snr_db": round(float(np.mean(snr)), 2),
                "wav_snr_db_min": round(float(np.min(snr)), 2),
            }
        )
    return rows


def markdown_table(result: dict[str, Any]) -> str:
    head = (
        "| precision | teacher-forced top-1 agreement | KL (nats) | free-run code agreement | first divergence "
        "| mel L1 | waveform SNR (dB) |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [
        f"| {r['precision']} | {r['tf_top1_agreement']:.4f} | {r['tf_kl_nats']:.5f} | "
        f"{r['free_run_code_agreement']:.4f} | step {r['free_run_first_divergence_step']} | {r['mel_l1']:.5f} | "
        f"{r['wav_snr_db']:.1f} |"
        for r in result["modes"]
    ]
    audio = [
        f"| audio {r['audio_dtype']} | - | - | {r['free_run_code_agreement']:.4f} | - | - | {r['wav_snr_db']:.1f} |"
        for r in result.get("audio_modes", [])
    ]
    return "\n".join([head, *lines, *audio])


def plot(result: dict[str, Any], path: str) -> bool:
    if not result["modes"]:
        return False
    names = [r["precision"] for r in result["modes"]]
    stats.save_plot(
        path,
        list(range(len(names))),
        [
            stats.Panel(
                "agreement",
                {
                    "teacher-forced top-1": [r["tf_top1_agreement"] for r in result["modes"]],
                    "free-run codes": [r["free_run_code_agreement"] for r in result["modes"]],
                },
            ),
            stats.Panel("waveform SNR (dB)", {"vs fp32": [r["wav_snr_db"] for r in result["modes"]]}),
        ],
        xlabel=" / ".join(f"{i}={n}" for i, n in enumerate(names)),
        title=f"quality vs fp32 ({result['num_texts']} texts x {result['steps']} steps)",
    )
    return True


def main(args: argparse.Namespace) -> int:
    return run_tool(args, run, plot)
