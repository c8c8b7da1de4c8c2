"""The fidelity cases shared by the golden test, the live reference test and scripts/make_kokoro_golden.py.

A case is what ``scripts/kokoro_reference_oracle.py`` reads: input ids with the 0 boundaries, a voice of
the tiny checkpoint, a speed and the seed of the sine source's noise.
"""

from __future__ import annotations

GOLDEN_CHECKPOINT_SEED = 11

# "həlˈO wˈɜɹld." and a longer run of ids, at three speeds and two voices (ids are the official vocab's).
CASES: list[dict] = [
    {"ids": [0, 50, 83, 54, 156, 31, 16, 65, 156, 87, 123, 54, 46, 4, 0], "voice": "af_heart", "speed": 1.0,
     "seed": 7},
    {"ids": [0, 61, 62, 135, 56, 16, 44, 138, 92, 3, 16, 53, 102, 123, 158, 47, 5, 0], "voice": "zf_xiaobei",
     "speed": 1.3, "seed": 3},
    {"ids": [0, 43, 102, 54, 55, 83, 157, 69, 123, 46, 16, 147, 86, 57, 0], "voice": "am_adam", "speed": 0.8,
     "seed": 12345},
]
