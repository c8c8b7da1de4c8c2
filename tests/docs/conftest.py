"""A server for the integration pages' examples: those clients (Pipecat, LiveKit, Home Assistant) cannot
send ChatTTS options, so the server's ``--default-options`` makes every request seeded and FIXED_TOKENS
steps long, and a test can compare the example's audio with a direct request's."""

from __future__ import annotations

import json

import pytest

from ..server.conftest import running_server

FIXED_TOKENS = 40
FIXED_DEFAULTS = json.dumps(
    {"seed": 1, "refine_text": False, "min_new_tokens": FIXED_TOKENS, "max_new_tokens": FIXED_TOKENS}
)


@pytest.fixture(scope="module")
def fixed_server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("doc-server"), "--default-options", FIXED_DEFAULTS) as base:
        yield base
