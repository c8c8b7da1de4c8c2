"""Schema fuzzing: schemathesis generates requests from the served OpenAPI document (valid ones and
broken ones) and sends them to a real server on 127.0.0.1. Every answer must be no server error, a
documented status, a documented content type and, for JSON, match its documented schema.

Bounded: a fixed number of examples per operation, a server whose audio budget keeps each generated
request short (the fuzzer picks large ``max_new_tokens`` and long texts), and an HTTP timeout per call.
"""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import running_server  # noqa: E402

pytestmark = pytest.mark.fuzz

KEY = "fuzz-key"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def fuzz_server(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    with running_server(
        tiny_ckpt,
        tmp,
        "--api-keys",
        KEY,
        "--max-num-seqs",
        "4",
        "--max-audio-seconds",
        "3",  # any bigger ask is a 400: keeps every generated request short
        "--max-input-chars",
        "200",
        "--max-voices",
        "50",
    ) as base:
        yield base


def _document() -> dict:
    """The OpenAPI document the server serves, built the same way without loading a model (schemathesis'
    fixture-based loader does not work with this pytest; the served copy is compared below)."""
    from chattts_serve.server.app import create_app
    from chattts_serve.server.config import ServerConfig

    return create_app(ServerConfig(model="unused")).openapi()


schema = schemathesis.openapi.from_dict(_document())


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_every_answer_is_documented_and_no_server_error(case, fuzz_server):
    case.call_and_validate(base_url=fuzz_server, headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS, timeout=60)


def test_the_served_document_is_the_fuzzed_one(fuzz_server):
    served = httpx.get(fuzz_server + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert served == schema.raw_schema


def test_the_document_declares_audio_errors_and_the_upload():
    """What the fuzzing relies on: without these the checks above would pass vacuously."""
    raw = schema.raw_schema
    speech = raw["paths"]["/v1/audio/speech"]["post"]["responses"]
    assert {"audio/mpeg", "audio/ogg", "audio/wav", "audio/pcm", "text/event-stream"} <= set(speech["200"]["content"])
    assert "422" not in speech and {"400", "401", "429", "503"} <= set(speech)
    upload = raw["paths"]["/v1/voices"]["post"]
    assert {"application/json", "multipart/form-data"} == set(upload["requestBody"]["content"])
    assert {"409", "415", "507"} <= set(upload["responses"])
    assert raw["components"]["schemas"]["ErrorBody"]["properties"]["error"]
