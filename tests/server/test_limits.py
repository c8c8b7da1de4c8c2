"""server/limits.py without a server: the in-flight bound and its 429."""

from __future__ import annotations

import pytest

from chattts_serve.server.errors import APIError
from chattts_serve.server.limits import Limits


def test_beyond_the_bound_is_a_429_with_retry_after_until_a_release():
    limits = Limits(2)
    limits.acquire()
    limits.acquire()
    with pytest.raises(APIError) as exc:
        limits.acquire()
    assert exc.value.status_code == 429 and exc.value.code == "capacity"
    assert exc.value.headers == {"Retry-After": "1"}
    assert limits.in_flight == 2  # a refused request holds nothing
    limits.release()
    limits.acquire()
    assert limits.in_flight == 2
