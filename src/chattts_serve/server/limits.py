"""How many requests a server runs at once: beyond ``max_in_flight``, new ones are refused with a 429 at
once instead of waiting in front of the engine's own queue. And which routes synthesise (``synthesis``):
the ones the tenant limits and replica recycling count."""

from __future__ import annotations

from collections.abc import Iterable

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


def synthesis(endpoint):
    """Tags a route's endpoint as one that synthesises (put it under the route decorator)."""
    endpoint.synthesis = True
    return endpoint


def synthesis_routes(routes: Iterable) -> frozenset[tuple[str, str, str]]:
    """(scope type, method, path) of the routes whose endpoint is tagged ``synthesis`` (method "" for a
    WebSocket): what ``is_synthesis`` looks a request up in. Taken from the routes as the routers define them,
    where the tag is (an app's own route list is the framework's business: FastAPI may keep included routers
    there as opaque entries)."""
    found = set()
    for route in routes:
        if getattr(getattr(route, "endpoint", None), "synthesis", False) is not True:
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
    kind = scope["type"]
    key = (kind, scope.get("method", "") if kind == "http" else "", route_path(scope))
    return key in scope["app"].state.synthesis_routes
