"""Kokoro's text front-end: text -> words with phonemes -> chunks of <= 510 -> input ids; word times.

Runs misaki (an optional extra, ``chattts-serve[kokoro]``) the way ``kokoro.KPipeline`` does, without
importing ``kokoro``.
"""

from chattts_serve.models.kokoro.text.chunking import chunk_phonemes, chunk_text
from chattts_serve.models.kokoro.text.g2p import G2P, LANGS, G2PUnavailable
from chattts_serve.models.kokoro.text.timestamps import WordTime, word_timestamps
from chattts_serve.models.kokoro.text.tokens import MAX_PHONEMES, Chunk, Token
from chattts_serve.models.kokoro.text.vocab import check_phonemes, phonemes_to_ids

__all__ = [
    "G2P", "LANGS", "MAX_PHONEMES", "Chunk", "G2PUnavailable", "Token", "WordTime",
    "check_phonemes", "chunk_phonemes", "chunk_text", "phonemes_to_ids", "word_timestamps",
]
