"""ChatTTS (2Noise/ChatTTS): an autoregressive GPT over text and audio codes, a DVAE decoder and Vocos.
Its ``ModelFamily`` is ``family.ChatTTSFamily``; ``stage.ChatTTSStage`` is how the engine runs it."""
