"""How many requests a server runs at once: beyond ``max_in_flight``, new ones are refused with a 429 at
once instead of waiting in front of the engine's own queue. And which routes do work the limits count:
the ones that synthesise (``synthesis``: the tenant limits and replica recycling count them), and other
costly work (``limited``: a voice upload decodes and encodes audio in worker threads; the tenant limits count
it, recycling does not)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from .errors import busy


class Limits:
    """Requests in flight, bounded (beyond it: 429)."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def acquire(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise busy(f"too many concurrent requests ({self.max_in_flight}); retry shortly")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one of the requests in flight for the block (429 at once when none is free)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


def synthesis(endpoint):
    """Tags a route's endpoint as one that synthesises (put it under the route decorator). Synthesis is
    limited work too."""
    endpoint.synthesis = endpoint.limited = True
    return endpoint


def limited(endpoint):
    """Tags a route's endpoint as costly work other than synthesis (put it under the route decorator): the
    tenant limits count it as they count synthesis."""
    endpoint.limited = True
    return endpoint


def synthesis_routes(routes: Iterable) -> frozenset[tuple[str, str, str]]:
    """(scope type, method, path) of the routes whose endpoint is tagged ``synthesis`` (method "" for a
    WebSocket): what ``is_synthesis`` looks a request up in. Taken from the routes as the routers define them,
    where the tag is (an app's own route list is the framework's business: FastAPI may keep included routers
    there as opaque entries)."""
    return _tagged(routes, "synthesis")


def limited_routes(routes: Iterable) -> frozenset[tuple[str, str, str]]:
    """The same for the routes tagged ``limited`` or ``synthesis``: what ``is_limited`` looks in."""
    return _tagged(routes, "limited")


def _tagged(routes: Iterable, tag: str) -> frozenset[tuple[str, str, str]]:
    found = set()
    for route in routes:
        if getattr(getattr(route, "endpoint", None), tag, False) is not True:
            continue
        methods = getattr(route, "methods", None)
        if methods:
            found |= {("http", m, route.path) for m in methods}
        else:
            found.add(("websocket", "", route.path))
    return frozenset(found)


def route_path(scope) -> str:
    """The path inside the app: Serve mounts an application under its route prefix (``root_path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_synthesis(scope) -> bool:
    """Whether an HTTP or WebSocket scope goes to a route tagged ``synthesis``, by the app's
    ``state.synthesis_routes`` (``scope["app"]`` is set before any middleware runs). A path inside a route
    prefix (Serve's ``root_path``) is the route's; a method the route does not serve (a 405) is not synthesis."""
    return _route_key(scope) in scope["app"].state.synthesis_routes


def is_limited(scope) -> bool:
    """Whether a scope goes to a route of limited work (``limited`` or ``synthesis``), by the app's
    ``state.limited_routes``."""
    return _route_key(scope) in scope["app"].state.limited_routes


def _route_key(scope) -> tuple[str, str, str]:
    kind = scope["type"]
    return (kind, scope.get("method", "") if kind == "http" else "", route_path(scope))
