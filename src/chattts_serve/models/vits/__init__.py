"""VITS in the Hugging Face ``VitsModel`` checkpoint layout (MMS-TTS and friends), our own implementation.

Weights licence: the MMS-TTS checkpoints (``facebook/mms-tts-*``, 1100+ languages) are released under
CC-BY-NC 4.0: non-commercial use only. Choosing one is choosing that licence; this package's code is
Apache-2.0 and ships no weights (``random_checkpoint`` writes random ones for tests).
"""
