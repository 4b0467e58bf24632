"""The live dashboard: the peers' status entries, the observer, the web app, a real browser.

Fast: the status entry's wire form and what every DHT node checks of it (forged, oversized,
malformed entries dropped), a peer's status built from its metrics records, the app's JSON state and
its ``/metrics`` output parsed by prometheus-client. Slow: real DHT nodes (a member's status read by
an observer holding the swarm key; one with a wrong key refused; one without a key reads nothing),
and a real ``gossiploco swarm --dashboard`` watched in headless Chromium.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from conftest import CHROMIUM, browser_or_skip, free_port, wait_until
from gossiploco.dashboard.app import create_app
from gossiploco.dashboard.observer import SwarmState
from gossiploco.membership.record import IncompatibleRecord
from gossiploco.membership.status import (MAX_HISTORY, MAX_STATUS_BYTES, StatusEntry, check_status_bytes,
                                          status_key)
from gossiploco.runtime.peer_status import PeerStatus
from gossiploco.security.identity import Identity
from gossiploco.membership.record_validator import SwarmRecordValidator, entry_subkey
from gossiploco.security.swarm_key import SwarmKey


def status(peer: int = 7, **fields) -> StatusEntry:
    base = dict(peer=peer, run_id="run-a", round=3, h=10, step=70, members=2, time=1.0, loss=2.5, val_loss=2.6,
                cd_l2=0.1, cd_js=0.01, bytes_sent=100, bytes_received=90, rate=12.5, failures={"mix1": 1},
                causes=["round 2: mix1: PeerUnreachable"], paths={"9": "direct"}, utilization=0.5, mix2=["*"],
                history=[[60, 2.7, None, 0.1, 0.01], [70, 2.5, 2.6, 0.1, 0.01]], tokens=8960)
    return StatusEntry(**{**base, **fields})


# -- the entry on the wire -------------------------------------------------------------------------


def test_status_entries_round_trip_and_malformed_ones_are_refused_naming_the_problem():
    entry = status()
    assert StatusEntry.from_wire(entry.to_wire()) == entry
    check_status_bytes(msgpack.packb(entry.to_wire()))
    check_status_bytes(msgpack.packb(None))  # a tombstone
    wire = entry.to_wire()
    bad = [
        ({**wire, "extra": 1}, "wrong fields"), ({k: v for k, v in wire.items() if k != "loss"}, "wrong fields"),
        ({**wire, "loss": float("nan")}, "loss"), ({**wire, "loss": "2.5"}, "loss"), ({**wire, "round": True}, "round"),
        ({**wire, "peer": -1}, "peer"), ({**wire, "run": "a\nb"}, "run"), ({**wire, "causes": ["x"] * 9}, "causes"),
        ({**wire, "causes": ["x" * 500]}, "cause"), ({**wire, "paths": {"me": "direct"}}, "paths"),
        ({**wire, "history": [[1, 2.0]]}, "history"), ({**wire, "history": [[1, 2, 3, 4, 5]] * (MAX_HISTORY + 1)}, "history"),
        ({**wire, "failures": {"mix1": -1}}, "failures"), ([1, 2], "dict"), ({**wire, "tokens": -1}, "tokens"),
        ({**wire, "tokens": 1.5}, "tokens"),
    ]
    for obj, word in bad:
        with pytest.raises(ValueError, match=word):
            StatusEntry.from_wire(obj)
    older = {k: v for k, v in wire.items() if k != "tokens"}  # a peer from before tokens were published
    assert StatusEntry.from_wire(older) == status(tokens=0)
    with pytest.raises(IncompatibleRecord):
        StatusEntry.from_wire({**wire, "version": 2})
    with pytest.raises(ValueError, match="oversized"):
        check_status_bytes(b"\x00" * (MAX_STATUS_BYTES + 1))
    with pytest.raises(ValueError, match="not msgpack"):
        check_status_bytes(b"\xc1")


def signed_status(validator: SwarmRecordValidator, peer: int, value: object) -> DHTRecord:
    key = DHTID.generate(source=status_key(validator.swarm)).to_bytes()
    record = DHTRecord(key, msgpack.packb(entry_subkey(validator.swarm, peer)), msgpack.packb(value), 1e10)
    return dataclasses.replace(record, value=validator.sign_value(record))


@pytest.mark.parametrize("private", [True, False])
def test_every_dht_node_stores_signed_statuses_and_refuses_forged_or_junk_ones(private):
    swarm, writer, forger = (SwarmKey.generate() if private else None), Identity.generate(), Identity.generate()
    honest, signer = SwarmRecordValidator(None, swarm), SwarmRecordValidator(writer, swarm)
    assert honest.validate(signed_status(signer, writer.peer_id, status(writer.peer_id).to_wire()))
    assert honest.validate(signed_status(signer, writer.peer_id, None))
    for junk in ({"loss": 1.0}, "y" * (MAX_STATUS_BYTES + 100), {**status().to_wire(), "history": "x"}):
        assert not honest.validate(signed_status(signer, writer.peer_id, junk))
    assert honest.rejected == {"bad status entry": 3}
    # a member writing another member's status: the subkey is not the signer's
    forged = signed_status(SwarmRecordValidator(forger, swarm), writer.peer_id, status(writer.peer_id).to_wire())
    assert not honest.validate(forged)
    if private:  # nobody without the swarm key writes at all
        outsider = SwarmRecordValidator(forger, SwarmKey.generate())
        assert not honest.validate(signed_status(outsider, forger.peer_id, status(forger.peer_id).to_wire()))


# -- a peer's status from its records -----------------------------------------------------------------


def test_a_peers_status_follows_its_records_within_the_wire_bounds():
    now = [100.0]
    built = PeerStatus(5, "run-a", ["*"], clock=lambda: now[0])
    assert StatusEntry.from_wire(built.wire()).round == -1  # valid before any record
    for step in range(0, 200, 2):
        now[0] += 1.0
        built.add({"round": step // 20, "h": step % 20, "step": step, "members": 2, "loss": 3.0 - step / 100,
                   "val_loss": float("nan") if step == 10 else None, "cd_l2": 0.1, "cd_js": 0.02, "compute_s": 0.5,
                   "bytes_sent": 1000 * step, "bytes_received": 1000 * step,
                   "mix2_cause": "ExchangeTimeout: " + "z" * 400 if step == 40 else None,
                   "mix2_decision": {"blocks": ["layers.0"]} if step == 60 else None}, {9: "direct", 11: "relayed"},
                  128 * (step + 2))
    entry = StatusEntry.from_wire(built.wire())
    assert (entry.round, entry.h, entry.step, entry.members) == (9, 18, 198, 2)
    assert len(entry.history) == MAX_HISTORY and entry.history[-1][0] == 198
    assert entry.failures == {"mix2": 1} and entry.causes[0].startswith("round 2: mix2: ExchangeTimeout")
    assert entry.paths == {"9": "direct", "11": "relayed"} and entry.mix2 == ["layers.0"]
    assert entry.rate == pytest.approx(4000.0) and entry.utilization == pytest.approx(0.5, abs=0.01)
    assert entry.tokens == 128 * 200  # the run's tokens as of the latest record
    assert len(msgpack.packb(entry.to_wire())) < MAX_STATUS_BYTES


# -- the web app ----------------------------------------------------------------------------------------


def fed_state() -> SwarmState:
    state = SwarmState(clock=lambda: 5.0)
    state.update({7: status(7), 9: status(9, round=4, history=[[80, 2.4, None, 0.2, 0.02]])},
                 {"run-a": {"workers": 2, "mix2": {"blocks": ["*"]}}})
    state.update({7: status(7, step=90, bytes_sent=3 * 2**20, history=[[90, 2.3, None, 0.1, 0.01]])})  # peer 9 left
    return state


def test_the_state_merges_history_and_marks_departed_peers():
    snapshot = fed_state().snapshot()
    assert snapshot["version"] == 2 and snapshot["runs"] == {"run-a": {"workers": 2, "mix2": {"blocks": ["*"]}}}
    assert [row[0] for row in snapshot["peers"]["7"]["points"]] == [60, 70, 90]  # peer 7's curve grows
    # traffic: the counters of each read, by step, in MiB
    assert snapshot["peers"]["7"]["traffic"] == [[70, 100 / 2**20, 90 / 2**20, 12.5 / 2**20], [90, 3.0, 90 / 2**20, 12.5 / 2**20]]
    assert snapshot["peers"]["7"]["live"] and not snapshot["peers"]["9"]["live"]
    state = fed_state()
    state.update(None)  # a failed read changes nothing
    assert state.version == 2 and state.failed_reads == 1


def test_the_app_serves_the_page_its_assets_and_the_json_state():
    with TestClient(create_app(fed_state(), port=8080), base_url="http://127.0.0.1:8080") as client:
        page = client.get("/")
        assert page.status_code == 200 and "/static/dashboard.js" in page.text and "http" not in page.text.lower()
        script = client.get("/static/dashboard.js")
        assert script.status_code == 200 and "EventSource" in script.text
        assert client.get("/static/dashboard.css").status_code == 200
        state = client.get("/api/state").json()
        assert set(state["peers"]) == {"7", "9"} and state["peers"]["9"]["round"] == 4


def test_the_metrics_endpoint_speaks_prometheus_with_a_sample_per_live_peer():
    with TestClient(create_app(fed_state(), port=8080), base_url="http://127.0.0.1:8080") as client:
        response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("round", "loss", "val_loss", "cd_l2", "cd_js", "bytes_sent", "utilization", "members", "failures",
                 "tokens"):
        assert f"gossiploco_{name}" in families, name
    loss = families["gossiploco_loss"].samples
    assert [(s.labels, s.value) for s in loss] == [({"peer": "7", "run": "run-a"}, 2.5)]  # peer 9 left
    failures = families["gossiploco_failures"].samples
    assert [(s.labels["kind"], s.value) for s in failures] == [("mix1", 1.0)]
    assert families["gossiploco_peers"].samples[0].value == 1.0


# -- who may read it: real HTTP requests to a real server ------------------------------------------------


def http_get(port: int, path: str, host: str | None, headers: dict | None = None) -> tuple[int, dict, str]:
    """One real HTTP/1.1 request to 127.0.0.1:``port`` with the ``Host`` header ``host`` (None: none at all)."""
    lines = [f"GET {path} HTTP/1.1", *([f"Host: {host}"] if host is not None else []), "Connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        found.setdefault(name.strip().lower(), []).append(value.strip())
    return int(status_line.split()[1]), found, body.decode("utf-8", "replace")


@pytest.fixture
def served():
    """A ``DashboardServer`` over ``fed_state()`` on 127.0.0.1 (``served(require_token=...)``), closed after."""
    from gossiploco.dashboard.app import DashboardServer

    servers = []

    def start(**kwargs):
        servers.append(DashboardServer(fed_state(), "127.0.0.1", free_port(), **kwargs).start())
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_the_dashboard_answers_only_requests_for_its_own_host_on_every_route(served):
    """DNS rebinding: a page at attacker.example, re-resolved to 127.0.0.1, sends ``Host: attacker.example``."""
    server = served()
    port = server.port
    for path in ("/", "/api/state", "/metrics", "/events", "/static/dashboard.js"):
        for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1:{port + 1}", f"127.0.0.1.nip.io:{port}"):
            status_code, _, body = http_get(port, path, host)
            assert status_code == 421 and "run-a" not in body and "gossiploco_loss" not in body, (path, host, body)
        assert http_get(port, path, None)[0] == 400  # no Host at all: uvicorn refuses it first
    assert server.app.state.refused.counts() == {"host": 20}
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        status_code, _, body = http_get(port, "/api/state", host)
        assert status_code == 200 and json.loads(body)["runs"] == {"run-a": {"workers": 2, "mix2": {"blocks": ["*"]}}}
    status_code, _, body = http_get(port, "/metrics", f"127.0.0.1:{port}")
    assert status_code == 200 and "gossiploco_loss" in body
    assert server.token is None and server.url == f"http://127.0.0.1:{port}/"  # loopback: no token asked


def test_served_beyond_loopback_the_dashboard_asks_for_its_token(served):
    from gossiploco.dashboard.access import allowed_hosts
    from gossiploco.dashboard.app import DashboardServer

    assert DashboardServer(fed_state(), "0.0.0.0", 8080).token is not None  # every interface: a token
    assert DashboardServer(fed_state(), "192.0.2.7", 8080).token is not None
    assert DashboardServer(fed_state(), "::1", 8080).token is None
    assert {"192.0.2.7:8080", "127.0.0.1:8080", "[::1]:8080"} <= allowed_hosts("192.0.2.7", 8080)
    assert f"{socket.gethostname().lower()}:8080" in allowed_hosts("0.0.0.0", 8080)
    server = served(require_token=True)  # what --host beyond loopback gets; loopback here, to stay on it
    port, token, host = server.port, server.token, f"127.0.0.1:{server.port}"
    assert server.url == f"http://127.0.0.1:{port}/?token={token}" and len(token) >= 40
    for path in ("/", "/api/state", "/metrics", "/events", "/static/dashboard.js"):
        status_code, headers, body = http_get(port, path, host)
        assert status_code == 401 and headers["www-authenticate"] == ['Bearer realm="gossiploco dashboard"'], path
        assert "run-a" not in body
    for wrong in ({"Authorization": "Bearer " + token[:-1] + "x"}, {"Cookie": f"gossiploco_dashboard_{port}=nope"},
                  {"Authorization": token}):
        assert http_get(port, "/api/state", host, wrong)[0] == 401
    assert http_get(port, f"/api/state?token={token}x", host)[0] == 401
    assert server.app.state.refused.counts() == {"token": 9}
    # the printed URL: the token becomes a cookie, and the address bar loses it
    status_code, headers, _ = http_get(port, f"/?token={token}", host)
    assert status_code == 303 and headers["location"] == ["/"]
    cookie = headers["set-cookie"][0]
    assert cookie.startswith(f"gossiploco_dashboard_{port}={token};") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert http_get(port, "/api/state", host, {"Cookie": cookie.split(";")[0]})[0] == 200
    assert http_get(port, "/metrics", host, {"Authorization": f"Bearer {token}"})[0] == 200  # Prometheus' way
    assert http_get(port, f"/metrics?token={token}", host)[0] == 200
    assert http_get(port, "/api/state", f"attacker.example:{port}", {"Authorization": f"Bearer {token}"})[0] == 421


# -- real DHT nodes -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_only_swarm_key_holders_can_observe_a_private_runs_status(bootstrap):
    from gossiploco.errors import DirectoryError
    from gossiploco.membership.dht_directory import DhtDirectory
    from gossiploco.membership.record import PeerRecord
    from gossiploco.membership.status import read_statuses
    from gossiploco.dashboard.observer import open_directory
    from gossiploco.security.trust import Trust

    key = SwarmKey.load(bootstrap.swarm_key)
    identity = Identity.generate()
    member = DhtDirectory("run-a", initial_peers=[bootstrap.address], heartbeat_s=0.5, ttl_s=5.0,
                          trust=Trust(identity, key))
    opened = []
    try:
        member.set_status_source(lambda: status(identity.peer_id).to_wire())
        member.announce(PeerRecord(identity.peer_id, "tcp://127.0.0.1:1", round=0, tokens=0, key=identity.curve_public))
        watcher = open_directory([bootstrap.address], key)
        opened.append(watcher)
        seen: dict = {}
        assert wait_until(lambda: seen.update(read_statuses(watcher) or {}) or identity.peer_id in seen, 10.0)
        assert seen[identity.peer_id].loss == 2.5
        with pytest.raises(DirectoryError, match="swarm key"):
            open_directory([bootstrap.address], SwarmKey.generate())
        stranger = open_directory([bootstrap.address], None)  # an open run's observer: nothing to confirm
        opened.append(stranger)
        assert read_statuses(stranger) == {} and read_statuses(stranger) == {}
        member.withdraw()  # leaving tombstones the status too
        assert wait_until(lambda: identity.peer_id not in (read_statuses(watcher) or {}), 10.0)
    finally:
        for directory in [*opened, member]:
            directory.close()


# -- a real swarm in a real browser ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_swarm_dashboard_shows_every_peer_live_in_a_real_browser(tmp_path):
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    port = free_port()
    log = (tmp_path / "swarm.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossiploco", "swarm", "--peers", "2", "--dashboard", "--dashboard-port", str(port),
         "--rounds", "60", "--inner-steps", "20", "--model", "tiny", "--set", "data.max_corpus_mb=2.0",
         "--set", "data.seq_len=32", "--set", "timeouts.discovery_s=1.0", "--out", str(tmp_path / "swarm")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        assert wait_until(lambda: _answers(url), 60.0, 0.2), (tmp_path / "swarm.log").read_text()[-3000:]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.goto(url, timeout=10_000)
                page.wait_for_function("document.getElementById('summary').dataset.peers === '2'", timeout=60_000)
                # tokens seen by the swarm: the live peers' own counts added up
                page.wait_for_function("Number(document.getElementById('summary').dataset.tokens) > 0", timeout=60_000)
                first = int(page.get_attribute("#summary", "data-round"))
                page.wait_for_function(f"Number(document.getElementById('summary').dataset.round) > {first}",
                                       timeout=60_000)
                for series in ("loss", "val_loss", "cd_l2", "cd_js", "mib_sent", "mib_rate"):
                    page.wait_for_function(f"Number(document.getElementById('chart-{series}').dataset.points) > 0",
                                           timeout=30_000)
                assert page.locator("#peers tbody tr").count() == 2
                assert "direct" in page.inner_text("#peers")
                # the links graph: both members, and the link between them drawn with its path
                page.wait_for_function("document.getElementById('links').dataset.links === '1'", timeout=30_000)
                assert page.locator("#links circle.node").count() == 2
                assert page.get_attribute("#links line.link", "data-path") == "direct"
                page.wait_for_selector("#config details", timeout=30_000)  # the run's config
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            finally:
                browser.close()
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


@pytest.mark.slow
def test_in_a_real_browser_the_token_url_opens_the_page_and_a_rebound_name_reads_nothing(served):
    """Chromium resolves attacker.example to 127.0.0.1 (what DNS rebinding achieves): the dashboard refuses
    it. The bare URL is refused without the token; the printed one sets the cookie and the page goes live."""
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    server = served(require_token=True)
    port = server.port
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--host-resolver-rules=MAP attacker.example 127.0.0.1"])
        try:
            page = browser.new_page()
            rebound = page.goto(f"http://attacker.example:{port}/api/state?token={server.token}", timeout=10_000)
            assert rebound.status == 421 and "run-a" not in page.content()
            assert page.goto(f"http://127.0.0.1:{port}/", timeout=10_000).status == 401
            opened = page.goto(server.url, timeout=10_000)
            assert opened.status == 200 and page.url == f"http://127.0.0.1:{port}/"  # the token left the address
            page.wait_for_function("document.getElementById('summary').dataset.peers === '1'", timeout=20_000)
            assert page.evaluate("fetch('/api/state').then(r => r.status)") == 200  # the cookie goes along
        finally:
            browser.close()
    refused = server.app.state.refused.counts()  # the browser asks for a favicon too, now and then
    assert set(refused) == {"host", "token"} and min(refused.values()) >= 1, refused


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "api/state", timeout=2) as response:
            return response.status == 200 and "peers" in json.loads(response.read())
    except OSError:
        return False


def test_the_page_and_its_assets_ship_inside_the_package():
    from gossiploco.dashboard.app import STATIC

    assert {p.name for p in STATIC.iterdir()} >= {"index.html", "dashboard.js", "dashboard.css"}
