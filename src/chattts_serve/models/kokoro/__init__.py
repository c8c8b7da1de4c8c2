"""Kokoro-82M (hexgrad/Kokoro-82M): StyleTTS 2 with an iSTFTNet decoder, in our own code."""
