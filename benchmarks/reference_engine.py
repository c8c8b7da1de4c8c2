"""The reference's side of bench_engine.py (runs in the reference environment).

For each N: one batched ``Chat.infer`` of N texts (split_text=False, fixed length); for N = 1 also
``stream=True`` to time its first chunk. Prints one JSON line.
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

TEXT = "今天天气真不错，我们一起去公园散步吧。"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chat = load_reference(Path(args.ckpt))

    def params():
        return chat.InferCodeParams(manual_seed=1, min_new_token=args.steps, max_new_token=args.steps, show_tqdm=False)

    chat.infer(
        TEXT,
        skip_refine_text=True,
        params_infer_code=chat.InferCodeParams(manual_seed=1, min_new_token=8, max_new_token=8, show_tqdm=False),
        split_text=False,
    )  # warm-up
    t0 = time.perf_counter()
    first = None
    for _ in chat.infer(TEXT, stream=True, skip_refine_text=True, params_infer_code=params(), split_text=False):
        if first is None:
            first = time.perf_counter() - t0
    stream_wall = time.perf_counter() - t0
    levels = []
    for n in (int(x) for x in args.concurrency.split(",")):
        t0 = time.perf_counter()
        chat.infer([TEXT] * n, skip_refine_text=True, params_infer_code=params(), split_text=False)
        wall = time.perf_counter() - t0
        audio_s = n * (args.steps * 512 - 256) / 24000
        levels.append({"n": n, "wall_s": round(wall, 3), "audio_s_per_s": round(audio_s / wall, 3)})
    print(
        json.dumps(
            {
                "impl": "reference chattts 0.2.5",
                "stream_first_chunk_s": round(first, 3),
                "stream_wall_s": round(stream_wall, 3),
                "levels": levels,
            }
        )
    )


if __name__ == "__main__":
    main()
