"""The reference side of ``chattts-serve bench family`` for Kokoro: the ``kokoro`` package (0.9.4) timed as its
users run it, one request at a time. Standalone: run under the reference environment's python, it imports
nothing from chattts_serve (the protocol is in ``chattts_serve/bench/family.py``)::

    REFPY reference_bench.py CKPT JOBS.json     # prints one JSON line

A request is {"text", "voice", "lang", "seed"}: ``KPipeline(lang_code)`` (``lang`` "zh" -> "z", "en" -> the
voice's English; the package's own text processing: misaki's G2P, its split at newlines) with ``KModel`` from
the checkpoint's files, the voice's pack (null: ``af_heart``, the package's default), speed 1,
``torch.manual_seed(seed)`` first. Offline the package phonemizes Chinese only (its English G2P needs spaCy's
``en_core_web_sm``, which is not on PyPI).

``load_model`` is also what ``scripts/kokoro_reference_oracle.py`` builds the package's model with: the package
hard-codes its decoder's widths (1024, and 64 for the ASR residual), so for a checkpoint whose config.json sets
``decoder_dim`` / ``asr_res_dim`` (our tiny test checkpoints) its ``Decoder`` is built at those widths from the
package's own modules; its forward is the package's. The official widths leave the package untouched.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

PACKAGE_WIDTHS = {"decoder_dim": 1024, "asr_res_dim": 64}
"""The widths ``kokoro/istftnet.py``'s ``Decoder`` writes in (and, through them, hidden_dim = 512)."""


def _decoder_at(width: int, asr_res: int):
    """The package's ``Decoder`` class with its hard-coded widths replaced by ``width`` and ``asr_res``."""
    from kokoro import istftnet

    class Decoder(istftnet.Decoder):
        def __init__(self, dim_in, style_dim, dim_out, **istft):
            super().__init__(dim_in, style_dim, dim_out, **istft)
            out = istft["upsample_initial_channel"]
            block = istftnet.AdainResBlk1d
            self.encode = block(dim_in + 2, width, style_dim)
            self.decode = nn.ModuleList([
                block(width + 2 + asr_res, width, style_dim),
                block(width + 2 + asr_res, width, style_dim),
                block(width + 2 + asr_res, width, style_dim),
                block(width + 2 + asr_res, out, style_dim, upsample=True),
            ])
            self.asr_res = nn.Sequential(istftnet.weight_norm(nn.Conv1d(dim_in, asr_res, kernel_size=1)))

    return Decoder


def load_model(ckpt: Path):
    """The package's ``KModel`` for checkpoint directory ``ckpt`` (fp32, CPU, eval)."""
    from kokoro import model as kmodel

    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    widths = {k: config.get(k, v) for k, v in PACKAGE_WIDTHS.items()}
    official = kmodel.Decoder
    if widths != PACKAGE_WIDTHS:
        kmodel.Decoder = _decoder_at(widths["decoder_dim"], widths["asr_res_dim"])
    try:
        return kmodel.KModel(repo_id="hexgrad/Kokoro-82M", config=config, model=str(ckpt / "kokoro-v1_0.pth")).eval()
    finally:
        kmodel.Decoder = official


def _lang_code(request: dict) -> str:
    voice = request.get("voice") or "af_heart"
    if request.get("lang") == "zh":
        return "z"
    return "b" if voice.startswith("b") else "a"


def main() -> None:
    ckpt, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
    torch.set_num_threads(int(jobs["threads"]))
    import kokoro
    from kokoro import KPipeline

    model = load_model(ckpt)
    pipelines: dict[str, KPipeline] = {}
    requests = jobs["requests"]

    def run(request: dict) -> float:
        """One request, as the package's user runs it; returns its audio seconds."""
        code = _lang_code(request)
        pipe = pipelines.get(code) or pipelines.setdefault(
            code, KPipeline(lang_code=code, repo_id="hexgrad/Kokoro-82M", model=model))
        voice = str(ckpt / "voices" / f"{request.get('voice') or 'af_heart'}.pt")
        torch.manual_seed(int(request.get("seed") or 0))
        samples = 0
        for result in pipe(request["text"], voice=voice, speed=1):
            samples += result.output.audio.shape[-1]
        return samples / 24000

    with torch.inference_mode():
        audio_s = [run(r) for r in requests]  # the warm-up: G2P dictionaries, oneDNN kernels, the voice packs
        single, sequential = [], []
        for _ in range(int(jobs["rounds"])):
            t0 = time.perf_counter()
            run(requests[0])
            single.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for request in requests[1:]:
                run(request)
            sequential.append(time.perf_counter() - t0)
    out = {
        "package": f"kokoro {kokoro.__version__}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "single_s": [round(t, 4) for t in single],
        "sequential_s": [round(t, 4) for t in sequential],
        "audio_s": [round(a, 4) for a in audio_s],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
