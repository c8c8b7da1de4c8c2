"""Time the reference ChatTTS on one utterance of a fixed length (runs in the reference environment).

    REF/bin/python benchmarks/reference_utterance.py CKPT --tokens 469 --repeats 3 --threads 2

Prints one JSON line: wall seconds per run (refine skipped, min = max new tokens fixed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from reference_oracle import load_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--tokens", type=int, default=469)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default="今天天气真不错，我们一起去公园散步吧。")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chat = load_reference(Path(args.ckpt))
    params = chat.InferCodeParams(manual_seed=1, min_new_token=args.tokens, max_new_token=args.tokens, show_tqdm=False)
    walls = []
    for _ in range(args.repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        chat.infer(args.text, skip_refine_text=True, params_infer_code=params, split_text=False)
        walls.append(time.perf_counter() - t0)
    print(json.dumps({"impl": "reference chattts 0.2.5", "tokens": args.tokens, "wall_s": walls[1:]}))


if __name__ == "__main__":
    main()
