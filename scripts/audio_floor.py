"""The audio stage's floor on one core (issue 33 item 2): what Decoder + Vocos cost per second of audio,
what one core can do, and where OpenVINO's bf16 graph spends a window.

    PYTHONPATH=src python scripts/audio_floor.py --model CKPT [--rounds 5]    # one JSON line (+ --markdown)

1. MACs per second of audio of each part, from the checkpoint's shapes (``read_config``): the Decoder's
   convolutions (its ConvNeXt blocks' depthwise convs and pointwise linears, the in/out convs), the Vocos
   backbone (embed conv, depthwise convs, pointwise linears), the head's projection, and the iSTFT (an
   irfft of N_FFT per frame, as ~2.5 N log2 N flops, plus the window and overlap-add: counted as MACs).
2. The core's peak: an unrolled loop of independent 512-bit FMA (fp32), VDPBF16PS (bf16) and VPDPBUSD
   (int8 VNNI) instructions (built with gcc when one is at hand), and what the libraries reach on the
   stage's largest GEMM (frames x 512 x 2048, the Decoder's pwconv1, and its transpose): torch (oneDNN)
   fp32 / bf16, OpenVINO f32 / bf16 / int8 (a one-MatMul graph quantized by nncf).
3. ``x real time at peak`` = peak MAC/s / MACs per audio second, per dtype: the ceiling of any kernel.
4. OpenVINO's per-op profile (``PERF_COUNT``) of ``--audio-dtype ov-bf16`` on a 1 x 150 window, grouped by
   op type and by part, plus the torch spectrum + iSTFT that follow the graph.

Run it on a quiet machine (figures are per thread: ``torch.set_num_threads(1)``, OpenVINO on 1 thread).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from chattts_serve.models.chattts.config import N_FFT, SAMPLE_RATE, TOKENS_PER_SECOND

FRAMES_PER_SECOND = 2 * TOKENS_PER_SECOND  # one GPT step = two mel frames = two Vocos frames

_PEAK_C = r"""
#include <immintrin.h>
#define ACC 12
#define BODY(OP) for (long i = 0; i < iters; i++) { _Pragma("GCC unroll 12") for (int j = 0; j < ACC; j++) OP; }
float peak_fp32(long iters, float x) {
    __m512 a[ACC], b = _mm512_set1_ps(x), c = _mm512_set1_ps(1.0f - x);
    for (int j = 0; j < ACC; j++) a[j] = _mm512_set1_ps((float)j);
    BODY(a[j] = _mm512_fmadd_ps(a[j], b, c))
    __m512 s = a[0]; for (int j = 1; j < ACC; j++) s = _mm512_add_ps(s, a[j]);
    return _mm512_reduce_add_ps(s);
}
float peak_bf16(long iters, float x) {
    __m512 a[ACC]; __m512bh b = (__m512bh)_mm512_cvtne2ps_pbh(_mm512_set1_ps(x), _mm512_set1_ps(x));
    for (int j = 0; j < ACC; j++) a[j] = _mm512_set1_ps((float)j);
    BODY(a[j] = _mm512_dpbf16_ps(a[j], b, b))
    __m512 s = a[0]; for (int j = 1; j < ACC; j++) s = _mm512_add_ps(s, a[j]);
    return _mm512_reduce_add_ps(s);
}
int peak_int8(long iters, int x) {
    __m512i a[ACC], b = _mm512_set1_epi8((char)x), c = _mm512_set1_epi8((char)(x + 1));
    for (int j = 0; j < ACC; j++) a[j] = _mm512_set1_epi32(j);
    BODY(a[j] = _mm512_dpbusd_epi32(a[j], b, c))
    __m512i s = a[0]; for (int j = 1; j < ACC; j++) s = _mm512_add_epi32(s, a[j]);
    return _mm512_reduce_add_epi32(s);
}
"""
# MACs per instruction: 16 fp32 lanes; 16 lanes x 2 bf16 pairs; 16 lanes x 4 u8*s8 products.
_MACS_PER_INSTR = {"fp32": 16, "bf16": 32, "int8": 64}


def _median_time(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def macs_per_audio_second(cfg) -> dict[str, float]:
    """MACs per second of 24 kHz audio, per part (the full stage at ``FRAMES_PER_SECOND`` frames)."""
    st, voc = cfg.decoder.stack, cfg.vocos
    k = st.kernel
    block = lambda dim, inter, kern: (dim * kern, 2 * dim * inter)  # noqa: E731 - (depthwise, pointwise)
    dec_dw, dec_pw = (st.num_layers * v for v in block(st.hidden, 4 * st.hidden, k))
    dec_io = st.idim * st.bn_dim * 3 + st.bn_dim * st.hidden * 3 + st.hidden * st.odim + st.odim * 100 * 3
    voc_dw, voc_pw = (voc.num_layers * v for v in block(voc.dim, voc.intermediate_dim, 7))
    voc_embed = 100 * voc.dim * 7
    head = voc.dim * (N_FFT + 2)
    istft = 2.5 * N_FFT * math.log2(N_FFT) / 2 + 2 * N_FFT  # irfft flops as MACs, window, overlap-add
    per_frame = {
        "decoder pointwise linears": dec_pw,
        "decoder depthwise convs": dec_dw,
        "decoder in/out convs": dec_io,
        "vocos pointwise linears": voc_pw,
        "vocos depthwise convs": voc_dw,
        "vocos embed conv": voc_embed,
        "head projection": head,
        "iSTFT (irfft + overlap-add)": istft,
    }
    return {name: v * FRAMES_PER_SECOND for name, v in per_frame.items()}


def core_peaks(iters: int = 20_000_000) -> dict[str, float]:
    """MAC/s of one core per dtype from the instruction loops; {} without gcc."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(_PEAK_C)
        subprocess.run(
            [
                cc,
                "-O3",
                "-shared",
                "-fPIC",
                "-mavx512f",
                "-mavx512bf16",
                "-mavx512vnni",
                "-mavx512bw",
                "-o",
                str(lib),
                str(src),
            ],
            check=True,
        )
        so = ctypes.CDLL(str(lib))
    so.peak_fp32.restype = so.peak_bf16.restype = ctypes.c_float
    so.peak_fp32.argtypes = so.peak_bf16.argtypes = [ctypes.c_long, ctypes.c_float]
    so.peak_int8.restype, so.peak_int8.argtypes = ctypes.c_int, [ctypes.c_long, ctypes.c_int]
    out = {}
    for name, fn, arg in (("fp32", so.peak_fp32, 0.5), ("bf16", so.peak_bf16, 0.5), ("int8", so.peak_int8, 1)):
        t = _median_time(lambda fn=fn, arg=arg: fn(iters, arg), 3)
        out[name] = iters * 12 * _MACS_PER_INSTR[name] / t
    return out


def _ov_matmul(m: int, k: int, n: int, precision: str, int8: bool):
    """A one-MatMul OpenVINO graph [m, k] x [k, n], compiled on one thread; int8: nncf-quantized."""
    import openvino as ov
    import openvino.opset13 as ops

    from chattts_serve.kernels import openvino as ovk

    rng = np.random.default_rng(0)
    x = ops.parameter([m, k], ov.Type.f32, name="x")
    w = ops.constant((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    model = ov.Model([ops.matmul(x, w, False, True)], [x])
    feed = rng.standard_normal((m, k)).astype(np.float32)
    if int8:
        import nncf

        model = nncf.quantize(model, nncf.Dataset([{"x": feed}]), subset_size=1)
    cfg = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": precision}
    req = ovk.compile_model(model, cfg).create_infer_request()
    return lambda: req.infer({0: feed})


def library_gemms(rounds: int) -> dict[str, dict[str, float]]:
    """GMAC/s on the stage's largest pointwise GEMMs (300 frames = a 1 x 150 window, 2400 = 8 x 150)."""
    out: dict[str, dict[str, float]] = {}
    shapes = [(300, 512, 2048), (300, 2048, 512), (2400, 512, 2048)]
    for m, k, n in shapes:
        key = f"{m}x{k}x{n}"
        row = out[key] = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            row[f"torch-{str(dtype)[6:]}"] = m * k * n / _median_time(lambda a=a, b=b: a @ b, rounds) / 1e9
        try:
            for name, prec, int8 in (("ov-f32", "f32", False), ("ov-bf16", "bf16", False), ("ov-int8", "bf16", True)):
                row[name] = m * k * n / _median_time(_ov_matmul(m, k, n, prec, int8), rounds) / 1e9
        except ImportError:
            pass
    return out


def _part(name: str) -> str:
    if "backbone" in name:
        return "vocos backbone"
    if "decoder" in name:
        return "decoder"
    if ".out" in name or "out/" in name:
        return "head projection"
    return "other"


def ov_profile(model, runtime: str, steps: int, rounds: int) -> dict:
    """Per-op time of the audio graph (``runtime``) on a 1 x ``steps`` window, one thread, medians of ``rounds``
    profiled runs: by OpenVINO node type / exec type and by part; plus the torch spectrum + iSTFT."""
    import openvino as ov

    from chattts_serve.audio.cpu_graph import _Convolutions
    from chattts_serve.kernels import openvino as ovk
    from chattts_serve.models.chattts.vocos import istft, spectrum_of_projection

    net = _Convolutions(model).eval()
    h = torch.randn(1, steps, model.config.gpt.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        graph = ov.convert_model(net, example_input=h[:, :8])
    prec = {"ov-fp32": "f32", "ov-bf16": "bf16"}.get(runtime, "bf16")
    cfg = {
        "INFERENCE_NUM_THREADS": 1,
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "PERF_COUNT": True,
        "INFERENCE_PRECISION_HINT": prec,
    }
    req = ovk.compile_model(graph, cfg).create_infer_request()
    feed = h.numpy()
    req.infer({0: feed})
    by_type: dict[str, list[float]] = defaultdict(list)
    by_part: dict[str, list[float]] = defaultdict(list)
    walls = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        req.infer({0: feed})
        walls.append(time.perf_counter() - t0)
        types: dict[str, float] = defaultdict(float)
        parts: dict[str, float] = defaultdict(float)
        for p in req.get_profiling_info():
            us = p.real_time.total_seconds() * 1e6
            if us <= 0:
                continue
            types[f"{p.node_type} ({p.exec_type})"] += us
            parts[_part(p.node_name)] += us
        for k, v in types.items():
            by_type[k].append(v)
        for k, v in parts.items():
            by_part[k].append(v)
    x = torch.from_numpy(req.infer({0: feed})[0].copy())
    head = model.vocos.head

    def tail():
        spec = spectrum_of_projection(x)
        return istft(spec, head.istft.window, head.envelope(spec.shape[2]))

    def spectrum_only():
        return spectrum_of_projection(x)

    spec = spectrum_of_projection(x)
    env = head.envelope(spec.shape[2])
    t_tail = _median_time(tail, rounds)
    t_spec = _median_time(spectrum_only, rounds)
    t_istft = _median_time(lambda: istft(spec, head.istft.window, env), rounds)
    med = lambda d: {k: round(statistics.median(v) / 1e3, 2) for k, v in sorted(d.items(), key=lambda kv: -sum(kv[1]))}  # noqa: E731
    return {
        "runtime": runtime,
        "window": f"1x{steps}",
        "graph_wall_ms": round(1e3 * statistics.median(walls), 2),
        "ms_by_op_type": med(by_type),
        "ms_by_part": med(by_part),
        "torch_tail_ms": {
            "spectrum": round(1e3 * t_spec, 2),
            "istft": round(1e3 * t_istft, 2),
            "spectrum+istft": round(1e3 * t_tail, 2),
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: peaks, gemms, profile")
    p.add_argument("--runtimes", default="ov-bf16", help="graphs to profile per op")
    args = p.parse_args()
    torch.set_num_threads(1)
    skip = set(args.skip.split(","))
    from chattts_serve.models.chattts.checkpoint import read_config, resolve

    cfg = read_config(resolve(args.model))
    macs = macs_per_audio_second(cfg)
    total = sum(macs.values())
    result: dict = {
        "macs_per_audio_s": {k: round(v / 1e6, 1) for k, v in macs.items()},
        "total_gmac_per_audio_s": round(total / 1e9, 3),
    }
    if "peaks" not in skip:
        peaks = core_peaks()
        result["core_peak_gmacs"] = {k: round(v / 1e9, 1) for k, v in peaks.items()}
        result["x_realtime_at_core_peak"] = {k: round(v / total, 1) for k, v in peaks.items()}
    if "gemms" not in skip:
        gemms = library_gemms(args.rounds)
        result["library_gemm_gmacs"] = {s: {k: round(v, 1) for k, v in r.items()} for s, r in gemms.items()}
        best = defaultdict(float)
        for r in gemms.values():
            for k, v in r.items():
                best[k] = max(best[k], v)
        result["x_realtime_at_library_gemm"] = {k: round(v * 1e9 / total, 1) for k, v in best.items()}
    if "profile" not in skip:
        from chattts_serve.models.chattts.checkpoint import load

        model = load(args.model)
        result["profiles"] = [ov_profile(model, r, args.steps, args.rounds) for r in args.runtimes.split(",")]
    result["audio_s_per_window"] = round((512 * args.steps - 256) / SAMPLE_RATE, 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
