"""transformers' VitsTokenizer + VitsModel as an oracle: run in the reference environment, never imported.

    python vits_reference_oracle.py CKPT CASES.json OUT.npz

CASES.json: {"texts": [str, ...], "cases": [{"text" or "ids", "speaking_rate", "noise_scale",
"noise_scale_duration", "seed", "speaker_id" (optional)}, ...]}. For each text: ``texts/i/ids`` (the tokenizer's
input_ids). For each case, at batch 1 on the CPU in fp32 with one thread: ``i/ids``, ``i/durations`` (frames
per input id, as transformers' forward computes them: captured from its duration predictor's output),
``i/audio`` (the waveform, its ``sequence_lengths`` long). ``torch.manual_seed(seed)`` right before the forward.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import VitsModel, VitsTokenizer  # noqa: E402


def main() -> None:
    ckpt, cases_path, out_path = sys.argv[1:4]
    torch.set_num_threads(1)
    spec = json.loads(open(cases_path, encoding="utf-8").read())
    tokenizer = VitsTokenizer.from_pretrained(ckpt)
    model, info = VitsModel.from_pretrained(ckpt, output_loading_info=True)
    model.eval()
    # from_pretrained only warns about these; an oracle that ran on half-random weights would prove nothing.
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"transformers did not load every tensor of {ckpt}: {problems}")
    out: dict[str, np.ndarray] = {}
    for i, text in enumerate(spec.get("texts", [])):
        out[f"texts/{i}/ids"] = np.array(tokenizer(text)["input_ids"], dtype=np.int64).reshape(-1)
    captured = {}

    def hook(module, args, output):
        captured["log_duration"] = output

    model.duration_predictor.register_forward_hook(hook)
    for i, case in enumerate(spec.get("cases", [])):
        ids = case["ids"] if "ids" in case else tokenizer(case["text"])["input_ids"]
        input_ids = torch.tensor([ids], dtype=torch.long)
        model.noise_scale = case["noise_scale"]
        model.noise_scale_duration = case["noise_scale_duration"]
        torch.manual_seed(case["seed"])
        with torch.no_grad():
            result = model(input_ids=input_ids, speaking_rate=case["speaking_rate"],
                           speaker_id=case.get("speaker_id"))
        length_scale = 1.0 / case["speaking_rate"]
        log_duration = captured["log_duration"]
        durations = torch.ceil(torch.exp(log_duration) * torch.ones_like(log_duration) * length_scale)
        out[f"{i}/ids"] = np.array(ids, dtype=np.int64)
        out[f"{i}/durations"] = durations.reshape(-1).long().numpy()
        n = int(result.sequence_lengths[0])
        out[f"{i}/audio"] = result.waveform[0, :n].numpy().astype(np.float32)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main()
