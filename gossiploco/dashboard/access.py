"""Who may read the dashboard: requests for its own address only, and, beyond loopback, token holders.

The dashboard shows a run's id, its full config, peer ids, losses and paths. Two ways a stranger gets at
them, and what stops each:

- **DNS rebinding.** A web page the operator visits (``attacker.example``) has its name re-resolved to
  127.0.0.1 and reads ``http://attacker.example:8080/api/state`` as its own origin. The browser then
  sends ``Host: attacker.example:8080``. ``AccessGuard`` answers every request whose ``Host`` header is
  not one of the dashboard's own names with **421 Misdirected Request**, on every route (the page, its
  assets, ``/api/state``, ``/events``, ``/metrics``), before the app sees it. Its own names
  (``allowed_hosts``): ``127.0.0.1:PORT``, ``localhost:PORT``, ``[::1]:PORT``, the address it serves on,
  and (served on every interface) this machine's name and addresses, plus any ``--allow-host``.
- **Anyone on the network**, once it is served beyond loopback (``--host`` other than a loopback address).
  Then a token is required (``new_token``, printed in the URL as ``?token=...``): on the page's request
  the query parameter sets an HttpOnly, SameSite=Strict cookie and redirects to the bare URL (the token
  leaves the address bar and the history); any request may also carry it as ``Authorization: Bearer``
  (Prometheus' ``authorization`` setting), the cookie, or the query parameter. Without it: **401**.

Refusals are counted by cause (``Refusals``) and logged, at most once per ``LOG_EVERY_S`` per
cause. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
TOKEN_PARAM = "token"
WILDCARDS = ("0.0.0.0", "::", "")


def new_token() -> str:
    """A fresh dashboard token (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether serving on ``host`` keeps the dashboard on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _authority(host: str, port: int) -> str:
    host = host.lower().strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _machine_names() -> set[str]:
    """This machine's host name, its fully qualified name and the addresses they resolve to (best effort)."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return {n for n in names if n}


def allowed_hosts(host: str, port: int, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` header values (``name:port``, lower case) a dashboard served on ``host:port`` answers.
    ``extra``: more names (``--allow-host``: a name it is reached by, such as a reverse proxy's)."""
    names = {"127.0.0.1", "localhost", "::1", *extra}
    if host in WILDCARDS:
        names |= _machine_names()
    else:
        names.add(host)
    allowed = {_authority(name, port) for name in names}
    if port == 80:  # a browser leaves the default port out
        allowed |= {a.rsplit(":", 1)[0] for a in allowed}
    return frozenset(allowed)


class Refusals:
    """Refused requests by cause ("host", "token"), logged at most once per ``LOG_EVERY_S`` per cause.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}

    def add(self, cause: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._counts[cause] += 1
            count = self._counts[cause]
            due = now - self._logged.get(cause, -LOG_EVERY_S) >= LOG_EVERY_S
            if due:
                self._logged[cause] = now
        if due:
            log.warning("dashboard: refused a request (%s: %s; %d refused for this cause so far)", cause, detail,
                        count)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class AccessGuard:
    """ASGI middleware in front of the dashboard app: ``Host`` checked on every request, then (when ``token``
    is set) the token; refusals go to ``refused``. Holds no per-request state."""

    def __init__(self, app: Any, *, hosts: frozenset[str], token: str | None, cookie: str, refused: Refusals):
        self.app, self.hosts, self.token, self.cookie, self.refused = app, hosts, token, cookie, refused

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "").strip().lower()
        if host not in self.hosts:
            self.refused.add("host", f"Host {host[:80]!r} for {scope.get('path', '')[:80]}")
            await _respond(send, 421, f"421 Misdirected Request: this dashboard does not answer for Host {host[:80]!r}"
                                      " (only for its own address; see gossiploco.dashboard.access)\n")
            return
        if self.token is not None:
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            given = dict(query).get(TOKEN_PARAM)
            if given is not None and self._valid(given):
                if scope.get("method") == "GET" and scope.get("path") == "/":
                    rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
                    await _respond(send, 303, "", [(b"location", ("/" + (f"?{rest}" if rest else "")).encode()),
                                                   (b"set-cookie", self._set_cookie())])
                    return
            elif not self._authorized(headers):
                self.refused.add("token", f"no valid token for {scope.get('path', '')[:80]}")
                await _respond(send, 401, "401 Unauthorized: open the URL `gossiploco dashboard` printed (with "
                                          "?token=...), or send Authorization: Bearer TOKEN\n",
                               [(b"www-authenticate", b'Bearer realm="gossiploco dashboard"')])
                return
        await self.app(scope, receive, send)

    def _valid(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._valid(credentials.strip()):
            return True
        cookies = SimpleCookie()
        try:
            cookies.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header carries no token
            return False
        morsel = cookies.get(self.cookie)
        return morsel is not None and self._valid(morsel.value)

    def _set_cookie(self) -> bytes:
        return f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict".encode()


async def _respond(send: Any, status: int, body: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = body.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
