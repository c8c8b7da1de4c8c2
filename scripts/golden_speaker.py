"""Regenerate tests/models/chattts/golden_speaker.json from the reference ``chattts==0.2.5``.

Run with the *reference* interpreter (it imports ``ChatTTS``, not ``chattts_serve``)::

    /path/to/refvenv/bin/python scripts/golden_speaker.py [--out tests/models/chattts/golden_speaker.json]

Records, on the CPU:
* ``Speaker.sample_random()`` after ``torch.manual_seed(seed)`` (string + raw float16 bytes),
* ``Speaker._encode`` of a few fixed embeddings,
* ``Speaker.encode_prompt`` of a few fixed code arrays,
* ``F.normalize`` (as in ``Speaker.apply``) of the sampled embeddings,
* the ``Config.spk_stat`` string.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from ChatTTS.config import Config
from ChatTTS.model.speaker import Speaker

SEEDS = [0, 1, 42, 1234, 2**31 - 1]


def f16_hex(t: torch.Tensor) -> str:
    return t.to(torch.float16).contiguous().numpy().astype("<f2").tobytes().hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=Path, default=here / "tests" / "model" / "golden_speaker.json")
    args = parser.parse_args()

    torch.set_num_threads(1)
    spk_stat = Config.spk_stat
    speaker = Speaker(768, spk_stat, torch.device("cpu"))

    samples = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        s = speaker.sample_random()
        emb = torch.from_numpy(Speaker._decode(s))
        normed = F.normalize(emb, p=2.0, dim=0, eps=1e-12)
        samples.append({"seed": seed, "string": s, "f16_hex": f16_hex(emb), "normalized_f16_hex": f16_hex(normed)})

    fixed = {
        "linspace768": torch.linspace(-3, 3, 768),
        "zeros16": torch.zeros(16),
        "tiny3": torch.tensor([0.5, -1.25, 65504.0]),
        "float32_rounding": torch.tensor([0.1, 0.2, 0.3, 1 / 3, 1e-5, -7.77777]),
    }
    encoded = [{"name": name, "f16_hex": f16_hex(t), "string": Speaker._encode(t)} for name, t in fixed.items()]

    gen = torch.Generator().manual_seed(7)
    prompts = {
        "randint_4x37": torch.randint(0, 626, (4, 37), generator=gen),
        "randint_4x300": torch.randint(0, 626, (4, 300), generator=gen),
        "ramp_1x5": torch.arange(5).view(1, 5) * 16000,
        "empty_4x0": torch.zeros(4, 0, dtype=torch.long),
    }
    prompt_cases = []
    for name, codes in prompts.items():
        s = Speaker.encode_prompt(codes)
        back = Speaker.decode_prompt(s)
        assert back.dtype == torch.int32 and torch.equal(back.long(), codes.long())
        prompt_cases.append(
            {
                "name": name,
                "shape": list(codes.shape),
                "codes_u16_hex": codes.numpy().astype("<u2").tobytes().hex(),
                "string": s,
            }
        )

    doc = {
        "reference": f"chattts=={importlib.metadata.version('chattts')}",
        "generator": "scripts/golden_speaker.py",
        "torch": torch.__version__,
        "spk_stat": spk_stat,
        "samples": samples,
        "encoded": encoded,
        "prompts": prompt_cases,
    }
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
