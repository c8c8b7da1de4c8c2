"""The fidelity cases shared by the golden test, the live reference test and scripts/make_vits_golden.py.

A case is what ``scripts/vits_reference_oracle.py`` reads: a text (tokenised by each side's own tokenizer) or
input ids, the speaking rate, both noise scales and the seed of ``torch.manual_seed`` before the forward.
"""

from __future__ import annotations

GOLDEN_CHECKPOINT_SEED = 11

# Texts for the tokenizer alone: casing, punctuation, characters outside the vocabulary, the pad token "k"
# (a letter of the English vocabulary, split out and emitted without blanks), the unk token spelled out.
TEXTS: list[str] = [
    "Hello, World!",
    "KKK kid",
    "Ünïcode café – 123 <unk> x_y",
    "  spaces  ",
    "it's a dog-eat-dog world; 4/5 k",
    "<unk>k<unk>",
    "ABC <UNK> Kk",
    "",
    "!!!",
    "k",
    "Ţara ț",
]

CASES: list[dict] = [
    {"text": "Hello, my dog is cute.", "speaking_rate": 1.0, "noise_scale": 0.667, "noise_scale_duration": 0.8,
     "seed": 7},
    {"text": "The quick brown fox jumps over the lazy dog", "speaking_rate": 1.3, "noise_scale": 0.5,
     "noise_scale_duration": 1.0, "seed": 3},
    {"text": "keep kicking, Kate!", "speaking_rate": 0.7, "noise_scale": 0.0, "noise_scale_duration": 0.0,
     "seed": 12345},
]
