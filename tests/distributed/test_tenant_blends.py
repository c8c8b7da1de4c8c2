"""Voice blends with tenants, on the app as a replica builds it: a blend's names are the caller's tenant's
voices (built-in names are everyone's), in every voice field and when a blend is saved."""

from __future__ import annotations

from .test_tenant_voices import _auth, _create, _openai_speak, _speak, _ws_start, replica  # noqa: F401


def test_a_blend_resolves_names_in_the_callers_tenant(replica):  # noqa: F811
    assert _create(replica, "kb", "b-part", seed=9).status_code == 201
    blend = "b-part(2)+alloy(1)"
    for r in (_speak(replica, "kb", blend), _openai_speak(replica, "kb", blend)):
        assert r.status_code == 200, r.text
    assert _ws_start(replica, "kb", blend)["type"] == "start"
    saved = replica.post("/v1/voices", json={"name": "b-mix", "speaker": blend}, headers=_auth("kb"))
    assert saved.status_code == 201, saved.text
    assert _speak(replica, "kb", "b-mix").content == _speak(replica, "kb", blend).content
    # tenant a has no "b-part": the same blend is an unknown voice there, named
    for r in (_speak(replica, "ka", blend), _openai_speak(replica, "ka", blend)):
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unknown_voice" and "'b-part'" in err["message"], r.text
    event = _ws_start(replica, "ka", blend)
    assert event["type"] == "error" and "b-part" in event["message"], event
    refused = replica.post("/v1/voices", json={"name": "a-mix", "speaker": blend}, headers=_auth("ka"))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unknown_voice"
