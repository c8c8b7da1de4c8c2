"""transformers' ``VitsModel`` timed on a benchmark's requests: the reference side of ``chattts-serve bench family``.

Run under the reference environment's python (it has transformers), never imported by the package (it imports
nothing from chattts_serve, and transformers only inside ``main``):

    REFPY reference_bench.py CKPT JOBS.json

JOBS.json: ``{"threads": N, "rounds": R, "requests": [REQUEST, ...]}``, a REQUEST being the family bench's
``{"text", "voice", "lang", "seed"}`` (``bench/family.py``: ``voice`` null or "default": the checkpoint's one
speaker, "speaker_N": speaker id N; ``lang`` is read by the checkpoint's tokenizer, not the request), with VITS's
own optional ``speaking_rate``, ``noise_scale`` and ``noise_scale_duration`` (null or absent: the checkpoint's).
Prints one JSON line: ``{"package": "transformers X.Y VitsModel", "single_s": [...], "sequential_s": [...],
"audio_s": [...]}``: per round, ``requests[0]`` alone, then ``requests[1:]`` one after another (each as
transformers' users run it: the tokenizer, ``torch.manual_seed(seed)``, a batch-1 forward under ``no_grad``); the
audio seconds of every request (from the first round). One untimed warm-up request runs first.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    ckpt, jobs_path = argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Run as a script, its own directory leads sys.path, and its siblings (kernels.py, config.py, ...) would
    # shadow the packages transformers imports by those names.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import torch
    import transformers
    from transformers import VitsModel, VitsTokenizer

    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    torch.set_num_threads(int(jobs.get("threads", 1)))
    requests = jobs["requests"]
    tokenizer = VitsTokenizer.from_pretrained(ckpt)
    model = VitsModel.from_pretrained(ckpt).eval()
    defaults = (model.noise_scale, model.noise_scale_duration, model.speaking_rate)
    rate = model.config.sampling_rate

    def run(request: dict) -> float:
        """One request, as a transformers user runs it; its audio's length in seconds."""
        ids = tokenizer(request["text"], return_tensors="pt")["input_ids"]
        noise, noise_duration, speaking_rate = (
            request.get(k) if request.get(k) is not None else d
            for k, d in zip(("noise_scale", "noise_scale_duration", "speaking_rate"), defaults, strict=True)
        )
        model.noise_scale, model.noise_scale_duration, model.speaking_rate = noise, noise_duration, speaking_rate
        if request.get("seed") is not None:
            torch.manual_seed(int(request["seed"]))
        voice = request.get("voice")
        speaker = None if voice in (None, "default") else int(str(voice).removeprefix("speaker_"))
        with torch.no_grad():
            out = model(input_ids=ids, speaker_id=speaker)
        return int(out.sequence_lengths[0]) / rate

    run(requests[0])  # warm-up: allocator, oneDNN primitives
    single, sequential, audio = [], [], []
    for _ in range(int(jobs.get("rounds", 1))):
        start = time.perf_counter()
        first = run(requests[0])
        single.append(time.perf_counter() - start)
        start = time.perf_counter()
        rest = [run(r) for r in requests[1:]]
        sequential.append(time.perf_counter() - start)
        audio = audio or [first, *rest]
    print(json.dumps({
        "package": f"transformers {transformers.__version__} VitsModel",
        "single_s": single,
        "sequential_s": sequential,
        "audio_s": audio,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
