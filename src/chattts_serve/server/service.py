"""API key comparison, shared by the HTTP middleware, the WebSocket handshake and the tenant limits.

It belongs with the one key parser, ``server/auth.py`` (issue 23 item 1), and moves there with it.
"""

from __future__ import annotations

import hmac


def key_matches(key: str, keys: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``keys``, in constant time (no early exit that times the match)."""
    found = False
    for k in keys:
        found |= hmac.compare_digest(key.encode(), k.encode())
    return found
