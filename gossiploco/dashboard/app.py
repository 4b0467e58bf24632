"""The dashboard's web app (Starlette): the page, its live updates and a Prometheus endpoint.

Routes: ``/`` the page (``static/index.html``); ``/static/...`` its script and style, shipped inside the
package (nothing is fetched from elsewhere); ``/api/state`` the ``SwarmState`` snapshot as JSON;
``/events`` server-sent events, one ``state`` event with the snapshot at once and after every change
(a comment every ``KEEPALIVE_S`` otherwise); ``/metrics`` the peers' latest figures in Prometheus'
text format, gauges labelled by ``peer`` and ``run`` (point Grafana's Prometheus at it).

Every route sits behind ``access.AccessGuard``: a request whose ``Host`` is not the dashboard's own is
answered 421 (DNS rebinding), and a dashboard served beyond loopback asks for its token (401 without).

``DashboardServer`` runs the app with uvicorn on a daemon thread, bounded start and stop. Stopping ends the
event streams first (``SwarmState.release``): a browser's stream never ends by itself, and uvicorn's graceful
shutdown would wait for it, then cancel it with an ERROR and a ``CancelledError`` traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gossiploco.dashboard.access import TOKEN_PARAM, AccessGuard, Refusals, allowed_hosts, is_loopback, new_token
from gossiploco.dashboard.observer import SwarmState
from gossiploco.errors import ConfigError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
WAIT_S = 1.0
"""How long an event stream waits for a change before it checks whether its client left."""
STREAMS_END_S = 3.0
"""How long ``DashboardServer.close`` waits for the event streams to end before it stops the server."""
GAUGES = {
    "round": "The round the peer is in.",
    "step": "The peer's global inner step (round x inner steps + h).",
    "loss": "Training loss of the latest measurement.",
    "val_loss": "Validation loss of the latest measurement that had one.",
    "cd_l2": "Consensus distance CD_L2 (swarm-wide).",
    "cd_js": "Consensus distance CD_JS (swarm-wide).",
    "bytes_sent": "Bytes the peer sent over the data plane.",
    "bytes_received": "Bytes the peer received over the data plane.",
    "rate": "Bytes per second sent and received lately.",
    "utilization": "Compute seconds over wall seconds since the peer started.",
    "members": "Peers in the group of the latest measurement.",
    "tokens": "Training tokens the peer has processed over its run.",
}


class StateCollector:
    """Prometheus collector over a ``SwarmState``: one gauge family per figure, a sample per live peer."""

    def __init__(self, state: SwarmState):
        self.state = state

    def collect(self):
        peers = self.state.snapshot()["peers"]
        for name, doc in GAUGES.items():
            family = GaugeMetricFamily(f"gossiploco_{name}", doc, labels=["peer", "run"])
            for peer, status in peers.items():
                if status["live"] and status.get(name) is not None:
                    family.add_metric([peer, status["run"]], float(status[name]))
            yield family
        failures = GaugeMetricFamily("gossiploco_failures", "Failed exchanges since the peer started, by kind.",
                                     labels=["peer", "run", "kind"])
        for peer, status in peers.items():
            if status["live"]:
                for kind, count in sorted(status["failures"].items()):
                    failures.add_metric([peer, status["run"], kind], float(count))
        yield failures
        yield GaugeMetricFamily("gossiploco_peers", "Live peers the dashboard sees.",
                                value=sum(1 for s in peers.values() if s["live"]))


class OpenStreams:
    """How many ``/events`` streams are open (thread-safe); the app keeps it in ``app.state.streams``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0

    def add(self, change: int) -> None:
        with self._lock:
            self._open += change

    @property
    def count(self) -> int:
        with self._lock:
            return self._open


def create_app(state: SwarmState, *, port: int, host: str = "127.0.0.1", token: str | None = None,
               allow_hosts: Sequence[str] = ()) -> Starlette:
    """The dashboard app over ``state`` (a ``SwarmState``, fed by a ``SwarmObserver`` or a test), for
    requests to ``host:port`` (``access.allowed_hosts``, plus ``allow_hosts``) carrying ``token`` if one is
    given. Its event streams end once ``state`` is released (``SwarmState.release``); ``app.state.refused``
    counts the requests refused (``access.Refusals``)."""
    streams, refused = OpenStreams(), Refusals()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StateCollector(state))

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def api_state(request: Request) -> Response:
        return JSONResponse(state.snapshot())

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def events(request: Request) -> Response:
        async def stream():
            seen, quiet = -1, 0.0
            streams.add(1)
            try:
                while not state.released and not await request.is_disconnected():
                    version = await asyncio.to_thread(state.wait_change, seen, 0.0 if seen < 0 else WAIT_S)
                    if state.released:
                        return
                    if version != seen:
                        seen, quiet = version, 0.0
                        yield f"event: state\ndata: {json.dumps(state.snapshot(), allow_nan=False)}\n\n"
                    else:
                        quiet += WAIT_S
                        if quiet >= KEEPALIVE_S:
                            quiet = 0.0
                            yield ": keepalive\n\n"
            finally:
                streams.add(-1)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    guard = Middleware(AccessGuard, hosts=allowed_hosts(host, port, allow_hosts), token=token,
                       cookie=f"gossiploco_dashboard_{port}", refused=refused)
    app = Starlette(routes=[
        Route("/", index), Route("/api/state", api_state), Route("/metrics", metrics), Route("/events", events),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ], middleware=[guard])
    app.state.streams, app.state.refused = streams, refused
    return app


class DashboardServer:
    """uvicorn serving ``create_app(state)`` on ``host:port`` from a daemon thread. ``start`` returns once it
    listens (``ConfigError`` if it cannot within ``timeout_s``); ``close`` ends the event streams (releasing
    ``state``), then stops it (bounded). ``require_token``: ask for a token (``token``, made here); None
    (default): only when served beyond loopback. ``url`` carries the token."""

    def __init__(self, state: SwarmState, host: str = "127.0.0.1", port: int = 8080, *,
                 require_token: bool | None = None, allow_hosts: Sequence[str] = ()):
        import uvicorn

        if not 1 <= port <= 65535:
            raise ConfigError("--port", f"the dashboard needs a port of its own (1-65535), got {port}")
        self.host, self.port = host, port
        self.state = state
        self.token = new_token() if (not is_loopback(host) if require_token is None else require_token) else None
        self.app = create_app(state, port=port, host=host, token=self.token, allow_hosts=allow_hosts)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=STREAMS_END_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="dashboard-server", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/`` (served on every interface: 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "[::1]" if self.host == "::" else self.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.port}/"

    @property
    def url(self) -> str:
        """The page's address, with ``?token=...`` when it asks for one (print this for the user)."""
        return self.base_url + (f"?{TOKEN_PARAM}={self.token}" if self.token else "")

    def start(self, timeout_s: float = 10.0) -> DashboardServer:
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self._server.started and self._thread.is_alive() and waited < timeout_s:
            deadline.wait(0.05)
            waited += 0.05
        if not self._server.started:
            self.close()
            raise ConfigError("--port", f"the dashboard could not listen on {self.host}:{self.port} "
                                        "(is the port taken?)")
        return self

    def close(self) -> None:
        self.state.release()
        streams, deadline = self.app.state.streams, time.monotonic() + STREAMS_END_S
        while streams.count and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._server.should_exit = True
        self._thread.join(timeout=STREAMS_END_S + 5.0)
        if self._thread.is_alive():
            log.error("dashboard: the web server did not stop")
