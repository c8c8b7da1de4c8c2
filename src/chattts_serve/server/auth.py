"""Who may use the server, decided once per connection for HTTP requests and WebSocket handshakes alike:
the API key and the tenant it belongs to (``resolve`` -> ``Principal``, kept in ``scope["state"]["auth"]``),
and the Host and Origin checks (``foreign``). ``Authenticate`` is the one middleware that refuses;
routes, the WebSocket handler and the tenant limits only read the ``Principal`` it stored.

The Host and Origin rules protect browsers' users: any web page may make their browser send requests here
(and a page whose name the attacker re-points at 127.0.0.1, DNS rebinding, may read the answers). A request
is refused when its ``Host`` is not an allowed name (by default, on a server listening on loopback, only
loopback names), or when it carries an ``Origin`` (browsers add it to cross-site requests, WebSocket
handshakes and same-site POSTs) that is neither allowed nor the server's own. Clients that are not browsers
send no ``Origin`` and pass.

The key rules. A key is ``Authorization: Bearer <key>`` or, on a WebSocket only (browsers cannot give one
headers), ``?api_key=<key>``; over HTTP a key in the URL would end up in logs and histories, so it counts
for nothing there. Credentials that could be read two ways are refused, never interpreted: repeated
``Authorization`` headers (or several folded into one), repeated ``api_key`` parameters, and a Bearer header
and an ``api_key`` that name different keys (each parser that once read "the first" or "the last" of them
let a tenant use one key for the check and another for its limits). With tenants, only a tenant's key is
accepted.

Whose data a request sees (``Principal.owner``): the result cache's entries and the saved voices belong to a
principal. A tenant's keys are one principal (the tenant); each plain ``--api-keys`` key is its own, unless
the operator declares the plain keys one (``--api-keys-shared``), as they all were before: otherwise one key
could read another's requests from a cache hit (``X-Cache``, or how fast the answer came) and list or delete
its voices. A server without keys has one principal, nobody's (``owner`` None).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from starlette.datastructures import Headers

from .openapi import error_response

PUBLIC_PATHS = ("/health", "/")  # the playground page is static HTML; it sends the key with its requests
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_INVALID = "missing or invalid API key"


def key_matches(key: str, keys: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``keys``, in constant time (no early exit that times the match)."""
    found = False
    for k in keys:
        found |= hmac.compare_digest(key.encode(), k.encode())
    return found


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The API keys a server accepts, each with the tenant it belongs to."""

    owners: tuple[tuple[str, str | None], ...] = ()
    """(key, tenant) pairs; tenant None: a plain ``--api-keys`` key."""
    by_tenant: bool = False
    """Keys belong to tenants: a key of no tenant is refused (even with no tenant at all), never served
    unlimited."""
    shared: bool = False
    """The plain keys are one principal (``--api-keys-shared``): they share the result cache and the saved
    voices. Otherwise each plain key is its own."""

    @classmethod
    def from_keys(cls, keys: Iterable[str], shared: bool = False) -> KeyRing:
        return cls(tuple((k, None) for k in keys), shared=shared)

    @classmethod
    def from_tenants(cls, tenants: Mapping[str, Iterable[str]]) -> KeyRing:
        """``tenants``: tenant name -> its keys."""
        return cls(tuple((k, name) for name, keys in tenants.items() for k in keys), by_tenant=True)

    @property
    def required(self) -> bool:
        return bool(self.owners) or self.by_tenant

    def owner(self, key: str) -> tuple[bool, str | None]:
        """Whether ``key`` is known, and its tenant. Every key is compared, in constant time."""
        known, tenant = False, None
        for k, t in self.owners:
            if hmac.compare_digest(key.encode(), k.encode()):
                known, tenant = True, t
        return known, tenant


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a connection is, as ``resolve`` found it. Holds no key: the scope state may be logged or shown."""

    key_present: bool
    """The request carried a key its transport reads, or ambiguous credentials."""
    authorized: bool
    """It may use protected routes: its key is one of the server's, or the server has no keys."""
    tenant: str | None = None
    """The tenant its key belongs to (None without tenants): whose limits it is under."""
    owner: str | None = None
    """Whose cached results and saved voices it sees: its tenant; for a plain key, the key's own
    (``key_owner``), or None when the plain keys are shared or the server has none."""
    problem: str = ""
    """Why it is not authorized; the refusal's message (never quotes a key)."""


def read_key(scope) -> tuple[str | None, str]:
    """The one key parser: (the key of an HTTP or WebSocket scope or None, the problem when its
    credentials are ambiguous or "")."""
    headers = [v for n, v in scope.get("headers", ()) if n == b"authorization"]
    # A comma is repeated headers folded into one (as proxies and some clients fold them); no key has one
    # (``--api-keys`` splits at commas).
    if len(headers) > 1 or (headers and b"," in headers[0]):
        return None, "more than one Authorization header: send one API key"
    header_key = None
    if headers:
        text = headers[0].decode("latin-1")
        if text[:7].lower() == "bearer ":
            header_key = text[7:].strip()
    query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    params = [v for name, v in query if name == "api_key"]
    if len(params) > 1:
        return None, "more than one api_key parameter: send one API key"
    if header_key is not None and params and not hmac.compare_digest(header_key.encode(), params[0].encode()):
        return None, "the Authorization header and the api_key parameter name different API keys"
    if header_key is not None:
        return header_key, ""
    return (params[0] if params and scope["type"] == "websocket" else None), ""


def resolve(scope, keys: KeyRing) -> Principal:
    """The principal of an HTTP or WebSocket scope."""
    key, problem = read_key(scope)
    present = key is not None or bool(problem)
    if not keys.required:
        return Principal(present, True)  # a server without keys reads none (and refuses none)
    if problem:
        return Principal(present, False, problem=problem)
    known, tenant = keys.owner(key) if key is not None else (False, None)
    if not known or (keys.by_tenant and tenant is None):
        return Principal(present, False, problem=_INVALID)
    owner = tenant if tenant is not None else None if keys.shared else key_owner(key)
    return Principal(present, True, tenant, owner)


def key_owner(key: str) -> str:
    """The principal of a plain API key, as the cache keys and the voice store name it: a fingerprint, never
    the key (the voice store and logs may be read by others). The ``:`` keeps it apart from every tenant name
    (``distributed.tenants.TENANT_NAME``), so a key's voices never mix with a tenant's."""
    return "key:" + hashlib.sha256(b"chattts-serve api key\0" + key.encode()).hexdigest()[:32]


def principal(scope) -> Principal | None:
    """The principal ``Authenticate`` stored for this connection (None: no ``Authenticate`` ran)."""
    return scope.get("state", {}).get("auth")


def foreign(scope, config) -> str | None:
    """Why an HTTP request or WebSocket handshake may not be served here: "host" (its ``Host`` names another
    server: DNS rebinding), "origin" (a browser page of another site sent it), or None. ``config``: the
    ``ServerConfig`` (``host``, ``allowed_hosts``, ``allowed_origins``)."""
    headers = Headers(scope=scope)
    host = headers.get("host")
    if not _host_allowed(host, scope, config):
        return "host"
    # Without the host check a rebound name would pass the origin check too (page and Host both the attacker's).
    if not _origin_allowed(headers.get("origin"), host or "", config.allowed_origins):
        return "origin"
    return None


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an IP address; IPv6 with or without brackets) is this machine's loopback."""
    name = (host or "").strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def open_to_anyone(host: str, keys: KeyRing) -> str | None:
    """The start-up warning for a server that listens beyond this machine without API keys, or None."""
    if keys.required or is_loopback(host):
        return None
    return (
        f"listening on {host} without API keys: anyone who can reach this address can use the server "
        "(set --api-keys, or listen on 127.0.0.1 behind a proxy that authenticates)"
    )


def _host_allowed(host: str | None, scope, config) -> bool:
    """``allowed_hosts`` ("*": any); when empty, only loopback names on a server that listens on loopback,
    any elsewhere. "Listens on loopback": ``config.host`` is a loopback address and the connection came to
    one (``scope["server"]``); under Ray Serve, ``config.host`` need not be where its proxy listens."""
    name = _host_name(host)
    if config.allowed_hosts:
        return "*" in config.allowed_hosts or name in {h.strip().strip("[]").lower() for h in config.allowed_hosts}
    local = (scope.get("server") or (None,))[0]
    if is_loopback(config.host) and is_loopback(local):
        return host is None or is_loopback(name)  # browsers always send Host: a request without one is no page's
    return True


def _host_name(host: str | None) -> str | None:
    """The name in a ``Host`` header, lower case, without its port (an IPv6 address without brackets)."""
    try:
        return urlsplit("//" + host.strip()).hostname if host else None
    except ValueError:
        return None


def _origin_allowed(origin: str | None, host: str, allowed: tuple[str, ...]) -> bool:
    """Browsers always send ``Origin`` on a WebSocket handshake, and a page of any site may open one or send
    a form's POST: without this check any web page a user visits could use the server (and its API key in
    the page's URL)."""
    if origin is None:
        return True  # not a browser: the check protects browsers' users only
    if allowed:
        return "*" in allowed or _norm_origin(origin) in {_norm_origin(o) for o in allowed}
    return _same_origin(origin, host)


def _norm_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _same_origin(origin: str, host: str) -> bool:
    """The origin's host:port is the Host header's (a missing port is the scheme's default)."""
    try:
        o, h = urlsplit(origin.strip()), urlsplit("//" + host.strip())
        default = _DEFAULT_PORTS.get(o.scheme)
        return o.hostname is not None and (o.hostname, o.port or default) == (h.hostname, h.port or default)
    except ValueError:  # a malformed port
        return False


async def refuse(scope, receive, send, problem: str = _INVALID) -> None:
    """The answer to credentials that do not let a request in: 401 over HTTP; on a WebSocket an error event
    ``invalid_api_key`` and close 1008 (the handshake is accepted first, so the client can read why)."""
    if scope["type"] == "websocket":
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        event = {"type": "error", "message": problem, "code": "invalid_api_key", "fatal": True}
        await send({"type": "websocket.send", "text": json.dumps(event)})
        await send({"type": "websocket.close", "code": 1008})
        return
    message = f"{problem} (Authorization: Bearer <key>)"
    response = error_response(401, message, "authentication_error", code="invalid_api_key")
    await response(scope, receive, send)


class Authenticate:
    """ASGI middleware: resolves each HTTP and WebSocket connection's principal once, into
    ``scope["state"]["auth"]``, and refuses a foreign Host (HTTP 400) or Origin (HTTP 403) on every route
    (a WebSocket handshake is refused: HTTP 403) and, on every route but ``PUBLIC_PATHS``, credentials that
    do not let it in.
    The config is read at each connection from ``app.state.config``, as the routes read it."""

    def __init__(self, app, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        who = resolve(scope, self.keys)
        scope.setdefault("state", {})["auth"] = who
        if problem := foreign(scope, scope["app"].state.config):
            if scope["type"] == "websocket":  # closing before accepting refuses the handshake: nothing is read
                return await send({"type": "websocket.close", "code": 1008})
            status = 400 if problem == "host" else 403
            return await error_response(status, f"{problem} not allowed", code=f"bad_{problem}")(scope, receive, send)
        if not who.authorized and not (scope["type"] == "http" and scope["path"] in PUBLIC_PATHS):
            return await refuse(scope, receive, send, who.problem)
        await self.app(scope, receive, send)
