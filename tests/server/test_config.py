"""ServerConfig: sub-configs behind the flat option names that users set (flags, CHATTTS_SERVE_*, Ray
``server`` keys), which must not change."""

from __future__ import annotations

import argparse

import pytest

from chattts_serve.engine.config import FLAT_OPTIONS
from chattts_serve.server.config import (
    SERVER_OPTIONS,
    ServerConfig,
    TimeoutConfig,
    WebSocketConfig,
    add_server_arguments,
    resolve_device,
)

# The names users rely on (flags, environment variables, deploy/ray-serve.yaml, docs): a rename breaks them.
PUBLISHED = """model family device host port api_keys api_keys_shared max_concurrent_streams max_connections
max_queue_wait_s max_input_chars max_body_bytes max_buffered_audio_s send_timeout_s header_timeout_s body_timeout_s
shutdown_timeout_s voices_db max_voices max_voice_text_chars max_upload_seconds default_voice
ws_max_message_bytes ws_max_text_chars ws_max_pending_sentences ws_idle_timeout_s ws_max_audio_seconds allowed_origins
allowed_hosts default_options lexicon cache_mb wyoming_uri wyoming_zeroconf warmup log_level log_format
threads""".split()


def test_the_flat_option_names_are_the_published_ones():
    assert sorted(SERVER_OPTIONS) == sorted(PUBLISHED)
    assert set(ServerConfig.flat_defaults()) == set(PUBLISHED) | set(FLAT_OPTIONS)


def test_a_bad_lexicon_fails_at_start_up(tmp_path):
    words = tmp_path / "words.json"
    words.write_text('{"乐": "le4"}', encoding="utf-8")
    with pytest.raises(ValueError, match="lexicon .*words.json: '乐': no common character reads only le4"):
        ServerConfig(lexicon=str(words))
    with pytest.raises(ValueError, match="cannot read it"):
        ServerConfig.from_env({"CHATTTS_SERVE_LEXICON": str(tmp_path / "missing.tsv")})


def test_flat_options_land_in_their_sub_config_and_round_trip():
    config = ServerConfig.from_flat(
        send_timeout_s=2.0, max_queue_wait_s=3.0, ws_max_text_chars=5, voices_db="/v.db", max_voices=7,
        default_voice="alice", wyoming_uri="tcp://0.0.0.0:10200", port=9000, max_num_seqs=3,
    )  # fmt: skip
    assert config.timeouts == TimeoutConfig(send_s=2.0, queue_wait_s=3.0)
    assert config.ws == WebSocketConfig(max_text_chars=5)
    assert (config.voices.db, config.voices.path, config.voices.max_count, config.voices.default) == (
        "/v.db",
        "/v.db",
        7,
        "alice",
    )
    assert (config.wyoming.uri, config.port, config.engine.scheduler.max_num_seqs) == ("tcp://0.0.0.0:10200", 9000, 3)
    assert ServerConfig.from_flat(**config.to_flat()) == config
    assert ServerConfig.from_flat(port=None) == ServerConfig()  # None: not set


def test_environment_then_flags():
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    environ = {
        "CHATTTS_SERVE_WS_IDLE_TIMEOUT_S": "9",
        "CHATTTS_SERVE_SEND_TIMEOUT_S": "4",
        "CHATTTS_SERVE_API_KEYS": "a, b",
        "CHATTTS_SERVE_WARMUP": "no",
        "CHATTTS_SERVE_PRECISION": "ort-auto",
        "CHATTTS_SERVE_ORT_AUTO_CROSSOVER": "6",
    }
    args = p.parse_args(["--send-timeout-s", "5", "--max-voices", "3", "--allowed-hosts", "x,y", "--max-num-seqs", "2"])
    config = ServerConfig.from_args(args, environ)
    assert (config.ws.idle_timeout_s, config.timeouts.send_s, config.voices.max_count) == (9.0, 5.0, 3)
    assert (config.api_keys, config.allowed_hosts, config.warmup) == (("a", "b"), ("x", "y"), False)
    assert (config.engine.precision, config.engine.scheduler.max_num_seqs) == ("ort-auto", 2)
    assert config.engine.runner.ort_auto_crossover == 6  # an int, read as one


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("ws_max_message_bytes", 0, "ws_max_message_bytes must be >= 1"),
        ("shutdown_timeout_s", 0.0, "shutdown_timeout_s must be > 0"),
        ("max_voice_text_chars", 0, "max_voice_text_chars must be >= 1"),
        ("max_body_bytes", 0, "max_body_bytes must be >= 1"),
        ("wyoming_uri", "10200", "wyoming_uri must be"),
        ("modell", "/m", "unknown server option"),
    ],
)
def test_errors_name_the_flat_option(option, value, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig.from_flat(**{option: value})


def test_resolve_device():
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("auto") in ("cpu", "cuda")
