"""``gossiploco dashboard``: watch a run live in a browser (``gossiploco.dashboard``).

``register(app)`` adds the command to the ``gossiploco`` app; ``start_dashboard`` is what ``gossiploco
swarm --dashboard`` calls with its own bootstrap address and swarm key. This module does not import
``gossiploco.cli``, so either can be loaded first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from gossiploco.errors import GossiplocoError
from gossiploco.runtime.stopping import stops_cleanly

if TYPE_CHECKING:
    from gossiploco.security.swarm_key import SwarmKey

console = Console(stderr=True)


class RunningDashboard:
    """An observer and its web server, started together and closed together (``close``, bounded)."""

    def __init__(self, join: Sequence[str], swarm: SwarmKey | None, *, host: str, port: int, dht_host: str,
                 timeout_s: float = 10.0, require_token: bool | None = None, allow_hosts: Sequence[str] = ()):
        from gossiploco.dashboard.app import DashboardServer
        from gossiploco.dashboard.observer import SwarmObserver, open_directory

        self.observer = SwarmObserver(open_directory(join, swarm, host=dht_host, timeout_s=timeout_s))
        try:
            self.server = DashboardServer(self.observer.state, host, port, require_token=require_token,
                                          allow_hosts=allow_hosts).start()
        except BaseException:
            self.observer.close()
            raise
        self.observer.start()

    @property
    def url(self) -> str:
        """The page's address (with its token, when it asks for one)."""
        return self.server.url

    def describe(self) -> str:
        """What to tell the user: where the page and the metrics are, and how to pass the token."""
        server = self.server
        if server.token is None:
            return f"dashboard: {server.url} (Prometheus: {server.base_url}metrics)"
        return (f"dashboard: {server.url}\n  (open it once: the token becomes a cookie; Prometheus: "
                f"{server.base_url}metrics with the header Authorization: Bearer {server.token})")

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self.observer.close()


def start_dashboard(join: Sequence[str], swarm: SwarmKey | None, *, host: str = "127.0.0.1", port: int = 8080,
                    dht_host: str = "127.0.0.1", require_token: bool | None = None,
                    allow_hosts: Sequence[str] = ()) -> RunningDashboard:
    """Join through ``join`` with ``swarm`` (None: an open run) and serve the page on ``host:port``
    (``DashboardServer``: beyond loopback, or with ``require_token``, only to holders of its token)."""
    return RunningDashboard(join, swarm, host=host, port=port, dht_host=dht_host, require_token=require_token,
                            allow_hosts=allow_hosts)


def dashboard(
    join: list[str] = typer.Option(..., "--join", help="Bootstrap multiaddr of the run's DHT (from `gossiploco dht`); repeat for several."),
    swarm_key: Optional[str] = typer.Option(None, "--swarm-key", help="The run's swarm key (file or gsk1-... text): only its holders can watch a private run."),
    open_run: bool = typer.Option(False, "--open", help="Watch a public run (no swarm key)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the web page is served on (0.0.0.0: every interface; beyond loopback a token is required, printed in the URL)."),
    port: int = typer.Option(8080, "--port", help="TCP port of the web page."),
    dht_host: str = typer.Option("0.0.0.0", "--dht-host", help="Address the observer's own DHT node listens on."),
    token: bool = typer.Option(False, "--token", help="Require the printed token on loopback too (a machine shared with other users)."),
    allow_host: Optional[list[str]] = typer.Option(None, "--allow-host", help="Another name the page is reached by (a reverse proxy's); requests for any other Host are refused. Repeatable."),
) -> None:
    """Watch a run live in a browser: join its DHT without training and serve a page with every peer's progress (and /metrics for Prometheus)."""
    from gossiploco.security.options import swarm_key_option

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        swarm = swarm_key_option(swarm_key, open_run)
        running = start_dashboard(join, swarm, host=host, port=port, dht_host=dht_host,
                                  require_token=True if token else None, allow_hosts=allow_host or ())
    except GossiplocoError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)
    console.print(f"{running.describe()}; Ctrl+C stops it", highlight=False, soft_wrap=True)
    try:
        threading.Event().wait()  # until Ctrl+C or SIGTERM (``runtime.stopping``)
    finally:
        running.close()


def register(app: typer.Typer) -> None:
    app.command()(stops_cleanly("dashboard")(dashboard))
