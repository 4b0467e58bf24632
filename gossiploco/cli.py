"""The ``gossiploco`` command line. Each command fills a config, builds the runtime, runs it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gossiploco.cli_options import (CONFIG, DATA, DEVICE, INIT, INNER_STEPS, LOG, MODEL, RESUME, ROUNDS, SEED, SETS,
                                    WORKERS, console, fail, training_overrides)
from gossiploco.cli_report import (PlainProgress, print_summary, print_swarm_summary, progress_line, progress_table,
                                   slowest_round)
from gossiploco.cli_data import data_app
from gossiploco.cli_tokenizer import tokenizer_app
from gossiploco.errors import ConfigError, GossiplocoError
from gossiploco.runtime import collector
from gossiploco.runtime.stopping import exit_stopped, stops_cleanly

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Decentralized LM training with Factored Gossip DiLoCo.")


@app.command()
@stops_cleanly("simulate")
def simulate(
    config: str = CONFIG,
    workers: Optional[int] = WORKERS,
    inner_steps: Optional[int] = INNER_STEPS,
    rounds: Optional[int] = ROUNDS,
    seed: Optional[int] = SEED,
    model: Optional[str] = MODEL,
    device: Optional[str] = DEVICE,
    data: Optional[list[str]] = DATA,
    init: Optional[str] = INIT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory: metrics.jsonl, summary.json, model, checkpoints/ (default runs/simulate, or runs/simulate-N when that holds a run)."),
    resume: bool = RESUME,
    set_: Optional[list[str]] = SETS,
    log: Optional[list[str]] = LOG,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Run M workers of Factored Gossip DiLoCo in one process (the virtual swarm)."""
    collector.pause()  # until the run starts (``runtime.collector``)
    from gossiploco.config import load_config
    from gossiploco.runtime.run_lifecycle import RunLifecycle
    from gossiploco.runtime.virtual import VirtualSwarm

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config, training_overrides(workers=workers, inner_steps=inner_steps, rounds=rounds, seed=seed,
                                                     model=model, device=device, data=data, init=init,
                                                     sets=set_, log=log))
        run = RunLifecycle.open(cfg, out, Path("runs/simulate"), resume=resume, say=console.print,
                                command="simulate")
        swarm = VirtualSwarm(cfg)
        run.start(swarm)
    except GossiplocoError as exc:
        fail(exc)
    console.print(
        f"[bold]{cfg.name}[/]: {cfg.workers} workers x {cfg.rounds} rounds x {cfg.inner_steps} inner steps, "
        f"model {cfg.model.describe()}, {swarm.corpus.description}, device {swarm.device}"
    )
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    # A terminal gets a bar redrawn in place; a pipe or a log file a line at least every PLAIN_EVERY_S seconds
    plain = PlainProgress(console) if not (quiet or console.is_terminal) else None
    with Progress(*columns, console=console, disable=quiet or plain is not None, transient=False) as progress:
        task = progress.add_task("training", total=cfg.total_inner_steps, completed=swarm.start_round * cfg.inner_steps)

        def on_step(advance: int, record: dict | None) -> None:
            progress.advance(task, advance)
            if record is not None:
                text = f"r {record['round']} h {record['h']}  L2 {record['cd_l2']:.3g}  JS {record['cd_js']:.3g}"
                if "loss" in record:
                    text += f"  loss {record['loss']:.3f}"
                progress.update(task, description=text)
            if plain is not None:
                done = int(progress.tasks[0].completed)
                plain.update(f"training: step {done}/{cfg.total_inner_steps}"
                             + (f" ({progress.tasks[0].description})" if progress.tasks[0].description != "training" else ""),
                             done // cfg.inner_steps)

        try:
            result = run.train(lambda sink, writer: swarm.run(sink, on_step, writer), before_report=progress.stop)
        except KeyboardInterrupt:  # stopped outside the run's own handling: the stop line (runtime.stopping)
            raise typer.Exit(code=130)
        except GossiplocoError as exc:
            progress.stop()
            fail(exc)
    _report(run.out, result.summary, run.finish(result))


@app.command()
@stops_cleanly("peer")
def peer(
    config: str = CONFIG,
    join: Optional[list[str]] = typer.Option(None, "--join", help="Bootstrap multiaddr of the run's DHT (from `gossiploco dht`); repeat for several."),
    rank: Optional[int] = typer.Option(None, "--rank", help="With --peers: this peer's index there (required). With --join: the index of its data stream (default: its peer id, which comes from --identity)."),
    swarm_key: Optional[str] = typer.Option(None, "--swarm-key", help="The run's swarm key: the file `gossiploco dht` or `gossiploco keygen` wrote, or its gsk1-... text. Runs are private: without it, only --open runs can be joined."),
    open_run: bool = typer.Option(False, "--open", help="Take part in a public run (no swarm key): anyone can join and affect the model."),
    identity: Optional[Path] = typer.Option(None, "--identity", help="With --join: this peer's key file (created if missing, mode 0600); its public key fixes the peer id (default: OUT/identity.key, or runs/identity.key without --out)."),
    peers: Optional[str] = typer.Option(None, "--peers", help="Instead of --join: every peer's address, comma-separated, in rank order: tcp://HOST:PORT,..."),
    host: str = typer.Option("0.0.0.0", "--host", help="With --join: address to listen on."),
    port: int = typer.Option(0, "--port", help="With --join: data-plane TCP port (0: any free port)."),
    announce: Optional[str] = typer.Option(None, "--announce", help="With --join: the host (or HOST:PORT) other peers reach this one at: your LAN or public address, or a forwarded port."),
    sealed_port: int = typer.Option(0, "--sealed-port", help="TCP port where peers that dial this one directly send their data sealed with AES-256-GCM, several times cheaper than CurveZMQ (0: any free port; -1: none, data stays on CurveZMQ). Behind a router, forward it too, or data to this peer stays on CurveZMQ."),
    dht_port: int = typer.Option(0, "--dht-port", help="With --join: TCP port of this peer's own DHT node (0: any; give one, forwarded, with --announce behind NAT)."),
    dht_node: Optional[str] = typer.Option(None, "--dht-node", help="With --join: use the DHT node another process of this machine serves at ipc://PATH (`gossiploco dht --local-peers`, `gossiploco swarm`) instead of starting one; several peers of one machine then share one node and its p2pd."),
    workers: Optional[int] = typer.Option(None, "--workers", "-m", help="With --join: the number of peers of the run, waited for before the first round (default: the preset's); every peer needs the same value."),
    new_run: bool = typer.Option(False, "--new-run", help="With --join: start this run even though the swarm runs another one with other settings (else this peer is refused, the differences named)."),
    resume: bool = RESUME,
    relay: Optional[list[str]] = typer.Option(None, "--relay", help="With --join: a relay multiaddr (/ip4/HOST/tcp/PORT/p2p/ID: a reachable DHT node) for when this peer is behind NAT; repeatable (default: the --join nodes)."),
    reachability: str = typer.Option("auto", "--reachability", help="With --join: auto (a dial-back check at start), public (skip the check: others can dial --announce) or nat (behind NAT: reverse connections and relays)."),
    inner_steps: Optional[int] = INNER_STEPS,
    rounds: Optional[int] = ROUNDS,
    seed: Optional[int] = SEED,
    model: Optional[str] = MODEL,
    device: Optional[str] = DEVICE,
    data: Optional[list[str]] = DATA,
    init: Optional[str] = INIT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default runs/peer-RANK)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Run id (default: preset name + digest of the config)."),
    set_: Optional[list[str]] = SETS,
    log: Optional[list[str]] = LOG,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and the final table."),
) -> None:
    """Run one peer: it joins a run through a DHT bootstrap address (--join) or a static list (--peers) and mixes over ZeroMQ."""
    collector.pause()  # until the run starts (``runtime.collector``)
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = None
    try:
        from gossiploco.config import load_config
        from gossiploco.runtime.dht_peer import joined_peer
        from gossiploco.runtime.peer import NetworkPeer, run_id_for
        from gossiploco.security.options import peer_trust, swarm_key_option
        from gossiploco.adversary import adversary_from_env
        from gossiploco.transport.fault_injection import hook_from_env

        if bool(join) == bool(peers):
            raise ConfigError("--join", "give either --join BOOTSTRAP_MULTIADDR (the DHT) or --peers LIST (a static list)")
        if dht_node and not join:
            raise ConfigError("--dht-node", "only with --join (a static --peers list uses no DHT)")
        if rank is None and peers:
            raise ConfigError("--rank", "required with --peers: this peer's index in the list")
        endpoints = [e.strip() for e in peers.split(",") if e.strip()] if peers else None
        if endpoints is not None:
            workers = len(endpoints)
            bad = [e for e in endpoints if not e.startswith("tcp://") or ":" not in e.removeprefix("tcp://")]
            if bad:
                raise ConfigError("--peers", f"expected tcp://HOST:PORT entries, got {bad}")
            if not 0 <= rank < workers:
                raise ConfigError("--rank", f"must be in 0..{workers - 1} (an index in --peers), got {rank}")
        swarm = swarm_key_option(swarm_key, open_run)
        fault_hook = hook_from_env()  # GOSSIPLOCO_FAULT (tests): read here, where the process is built
        adversary = adversary_from_env()  # GOSSIPLOCO_ATTACK (the attack bench), likewise
        cfg = load_config(config, training_overrides(workers=workers, inner_steps=inner_steps, rounds=rounds, seed=seed,
                                                     model=model, device=device, data=data, init=init,
                                                     sets=set_, log=log))
        if not -1 <= sealed_port < 65536:
            raise ConfigError("--sealed-port", f"must be a TCP port, 0 (any free one) or -1 (none), got {sealed_port}")
        if join:
            trust = peer_trust(swarm, identity_file=identity or (out or Path("runs")) / "identity.key")
            node = joined_peer(cfg, trust, rank, join, host, port, announce, run_id or run_id_for(cfg), dht_port,
                               relays=relay or [], reachability=reachability, new_run=new_run, fault=fault_hook,
                               shared_node=dht_node, sealed_port=sealed_port)
            rank = trust.peer_id
        else:
            node = NetworkPeer(cfg, rank, endpoints, run_id=run_id, fault=fault_hook, sealed_port=sealed_port,
                               trust=peer_trust(swarm, static_rank=rank, static_count=len(endpoints)))
        if adversary is not None:
            node.set_adversary(adversary)
    except GossiplocoError as exc:
        fail(exc)
    except KeyboardInterrupt:  # during start-up (loading data, starting the DHT node): nothing to keep
        if node is not None:
            node.close()
        exit_stopped("peer", "during start-up")
    try:
        from gossiploco.runtime.run_lifecycle import RunLifecycle

        out = out or Path(f"runs/peer-{rank}")
        # never over a run without --resume; a peer stopped before its first record leaves no run there
        run = RunLifecycle.open(cfg, out, out, resume=resume, say=console.print, forget_unstarted=True,
                                command="peer")
        run.start(node)
    except GossiplocoError as exc:
        node.close()
        fail(exc)
    console.print(f"[bold]{cfg.name}[/] peer {rank} at {node.endpoint}: {cfg.rounds} rounds x "
                  f"{cfg.inner_steps} inner steps, model {cfg.model.describe()}, device {node.device}, run {node.run_id}")

    def on_record(record: dict) -> None:
        if quiet:
            return
        text = f"rank {rank} r {record['round']} h {record['h']}"
        if "cd_l2" in record:
            text += f"  L2 {record['cd_l2']:.3g}  JS {record['cd_js']:.3g}"
        if "loss" in record:
            text += f"  loss {record['loss']:.3f}"
        console.print(text)

    try:
        result = run.train(lambda sink, writer: node.run(sink, on_record, writer))
    except KeyboardInterrupt:  # stopped outside the run's own handling: the stop line (runtime.stopping)
        raise typer.Exit(code=130)
    except GossiplocoError as exc:
        fail(exc)
    _report(run.out, result.summary, run.finish(result))


def _report(out: Path, summary: dict, model_path: Path) -> None:
    """The end of a finished run: its summary table and where it wrote what."""
    print_summary([summary])
    console.print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}  model: {model_path}")


@app.command()
@stops_cleanly("keygen")
def keygen(out: Path = typer.Option(..., "--out", "-o", help="File to write the new swarm key to (mode 0600); never overwritten.")) -> None:
    """Write a new swarm key: the secret that makes a run private. Give it to every peer (--swarm-key)."""
    from gossiploco.security.swarm_key import SwarmKey

    if out.exists():
        fail(ConfigError("--out", f"{out} exists; a swarm key is never overwritten (remove it first)"))
    from gossiploco.security.key_files import commit_warning

    key = SwarmKey.generate()
    try:
        key.save(out, exclusive=True)
    except FileExistsError:
        fail(ConfigError("--out", f"{out} exists; a swarm key is never overwritten (remove it first)"))
    console.print(f"swarm key {key.fingerprint} written to {out}; peers join with --swarm-key {out}")
    warning = commit_warning(out)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


@app.command()
@stops_cleanly("dht")
def dht(
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on."),
    port: int = typer.Option(0, "--port", help="TCP port (0: any free one; give a fixed one for an address that survives restarts)."),
    announce: Optional[list[str]] = typer.Option(None, "--announce", help="Multiaddr to advertise instead, e.g. /ip4/PUBLIC_IP/tcp/PORT (behind NAT or a forwarded port); repeatable."),
    identity: Optional[Path] = typer.Option(None, "--identity", help="Private key file: keeps the same peer id (and so the same multiaddrs) across restarts; created if missing."),
    swarm_key: Optional[str] = typer.Option(None, "--swarm-key", help="The run's swarm key: a file (used if it exists, else created, mode 0600) or the gsk1-... text. Default: your own key in $XDG_CONFIG_HOME/gossiploco/swarm.key (~/.config/gossiploco/swarm.key), created on the first start and reused after, never a swarm.key in the current directory. Key files tracked by git or readable by others are refused."),
    open_run: bool = typer.Option(False, "--open", help="A public run: no swarm key; records are still signed."),
    join: Optional[list[str]] = typer.Option(None, "--join", help="Join an existing run's DHT (another bootstrap multiaddr): a second bootstrap node and relay for peers behind NAT; repeatable."),
    relay_data_mb: float = typer.Option(4096.0, "--relay-data-mb", help="Relaying for peers behind NAT: MiB per direction one relayed connection may carry before it is reset (peers renew theirs before)."),
    relay_time_s: float = typer.Option(1800.0, "--relay-time-s", help="Relaying: the longest life of one relayed connection, in seconds."),
    local_peers: Optional[Path] = typer.Option(None, "--local-peers", help="Also serve this node to the peers of this machine through a socket in this directory (made private): each `gossiploco peer --dht-node ipc://DIR/dht.sock` then uses it instead of starting a DHT node and p2pd of its own (a machine with several GPUs, one peer each)."),
) -> None:
    """Run a bootstrap DHT node (which also relays for peers behind NAT) for peers to --join; prints a paste-ready join command; Ctrl+C stops it."""
    from gossiploco.membership.bootstrap import serve_bootstrap
    from gossiploco.security.options import bootstrap_swarm_key

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = None
    try:
        if open_run and swarm_key:
            raise ConfigError("--open", "give either --swarm-key (a private run) or --open (a public run), not both")
        if not open_run:
            key, where = bootstrap_swarm_key(swarm_key)
            console.print(where, highlight=False, soft_wrap=True)
    except GossiplocoError as exc:
        fail(exc)

    def ready(addresses: list[str], local: str | None = None) -> None:
        console.print("[bold]bootstrap DHT node ready.[/] "
                      + ("Public run: anyone can join." if key is None else
                         f"Private run (swarm key {key.fingerprint}): the command carries the key, share it "
                         f"privately (or copy the key file and pass --swarm-key FILE)."))
        secret = "--open" if key is None else f"--swarm-key {key.text}"
        for address in addresses:
            print(f"  gossiploco peer --config PRESET --join {address} {secret}", flush=True)
        if local is not None:
            console.print("Peers of this machine share this node by adding:", highlight=False)
            print(f"  --dht-node {local}", flush=True)

    try:
        serve_bootstrap(host, port, announce, identity, on_ready=ready, swarm=key, open_run=open_run, join=join or [],
                        relay_limits=(relay_data_mb * (1 << 20), relay_time_s), local_peers=local_peers)
    except GossiplocoError as exc:
        fail(exc)


@app.command()
@stops_cleanly("doctor")
def doctor(
    join: Optional[list[str]] = typer.Option(None, "--join", help="Bootstrap multiaddr of the run's DHT (from `gossiploco dht`): check it answers, and this machine's reachability and clock; repeat or comma-separate for several."),
    swarm_key: Optional[str] = typer.Option(None, "--swarm-key", help="With --join: the run's swarm key (file or gsk1-... text); check the bootstrap node holds the same one."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address the peer would listen on."),
    port: int = typer.Option(0, "--port", help="Data-plane TCP port the peer would use (0: any free port)."),
    dht_port: Optional[int] = typer.Option(None, "--dht-port", help="DHT port the peer would use: check it is free too."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds for each network check (default: timeouts.hello_s + 5)."),
    json_: bool = typer.Option(False, "--json", help="Print the checks as a JSON list of {name, status, detail, fix}."),
) -> None:
    """Check this machine before joining a swarm: Python, torch and device, packages, libzmq CURVE, ports, and with --join the bootstrap, swarm key, reachability and clock. Exit 1 if anything FAILs."""
    import json

    from gossiploco.runtime.doctor import format_checks, run_doctor, summary

    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    checks = run_doctor(join=join, host=host, port=port, dht_port=dht_port, swarm_key=swarm_key, timeout_s=timeout)
    if json_:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        print(format_checks(checks))
        print(summary(checks))
    if any(c.status == "FAIL" for c in checks):
        raise typer.Exit(code=1)


@app.command()
@stops_cleanly("swarm")
def swarm(
    config: str = CONFIG,
    peers: int = typer.Option(4, "--peers", "-n", help="Number of peer processes."),
    inner_steps: Optional[int] = INNER_STEPS,
    rounds: Optional[int] = ROUNDS,
    seed: Optional[int] = SEED,
    model: Optional[str] = MODEL,
    device: Optional[str] = DEVICE,
    data: Optional[list[str]] = DATA,
    init: Optional[str] = INIT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory: summary.json plus peer-I/ (metrics, summary, model, checkpoints) and peer-I.log (default runs/swarm, or runs/swarm-N when that holds a run)."),
    resume: bool = typer.Option(False, "--resume", help="Restart a stopped swarm: every peer continues from its newest checkpoint in --out (default: the newest runs/swarm*)."),
    set_: Optional[list[str]] = SETS,
    log: Optional[list[str]] = LOG,
    dashboard: bool = typer.Option(False, "--dashboard", help="Also serve a live web dashboard of the swarm (gossiploco dashboard) and print its URL."),
    dashboard_port: int = typer.Option(8080, "--dashboard-port", help="With --dashboard: TCP port of the page (on 127.0.0.1)."),
    dht_per_peer: bool = typer.Option(False, "--dht-per-peer", help="Give every peer its own DHT node and p2pd and its own dial-back check, as on separate machines (default: the peers share the bootstrap's node)."),
) -> None:
    """The main job: a bootstrap DHT node and N peer processes on this machine, training together with live progress."""
    import shlex

    from rich.live import Live

    from gossiploco.config import load_config
    from gossiploco.runtime.peer import run_id_for
    from gossiploco.runtime.swarm import LocalSwarm

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if peers < 1:
            raise ConfigError("--peers", f"must be at least 1, got {peers}")
        cfg = load_config(config, training_overrides(workers=peers, inner_steps=inner_steps, rounds=rounds, seed=seed,
                                                     model=model, device=device, data=data, init=init,
                                                     sets=set_, log=log))
        from gossiploco.runtime.run_dir import output_dir

        out = output_dir(out, Path("runs/swarm"), resume)
    except GossiplocoError as exc:
        fail(exc)
    args = ["--config", config, "--run-id", run_id_for(cfg), "--quiet"] + (["--resume"] if resume else [])
    for flag, value in (("--inner-steps", inner_steps), ("--rounds", rounds), ("--seed", seed), ("--model", model),
                        ("--device", device), ("--init", init)):
        if value is not None:
            args += [flag, str(value)]
    for path in data or []:
        args += ["--data", path]
    for item in set_ or []:
        args += ["--set", item]
    for item in log or []:  # each peer logs its own records into its own directory (peer-I/)
        args += ["--log", item]
    console.print(f"[bold]{cfg.name}[/]: {peers} peers x {cfg.rounds} rounds x {cfg.inner_steps} inner steps, model "
                  f"{cfg.model.describe()}; peers run `gossiploco peer {shlex.join(args)} --join BOOTSTRAP`; logs in {out}/")
    local = LocalSwarm(peers, out, args, on_bootstrap=_swarm_dashboard(dashboard_port) if dashboard else None,
                       dht_per_peer=dht_per_peer)
    # A terminal gets a table redrawn in place; a pipe or a log file, where that shows nothing until the end, a line
    # at least every PLAIN_EVERY_S seconds
    live = Live(progress_table(local.progress, cfg.rounds), console=console, refresh_per_second=2, transient=False,
                redirect_stdout=False) if console.is_terminal else None
    plain = PlainProgress(console)
    show = (lambda progress: live.update(progress_table(progress, cfg.rounds))) if live is not None else \
        (lambda progress: plain.update(progress_line(progress, cfg.rounds), slowest_round(progress)))
    try:
        if live is not None:
            live.start()
        summary = local.run(show)
    except GossiplocoError as exc:  # e.g. OUT/swarm.key refused on --resume
        fail(exc)
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        exit_stopped("swarm", f"the peers stopped; what they wrote is in {out}/ (summary.json)")
    finally:
        if live is not None:
            live.stop()
    console.print()
    print_swarm_summary(summary)
    failed = {p["rank"]: p["exit_code"] for p in summary["per_peer"] if p["exit_code"] != 0}
    console.print(f"swarm summary: {out / 'summary.json'}; per peer: {out}/peer-I/")
    if failed:
        console.print(f"[bold red]peers that did not finish:[/] {failed} (exit codes); see {out}/peer-I.log")
        raise typer.Exit(code=1)


def _swarm_dashboard(port: int):
    """``LocalSwarm``'s ``on_bootstrap`` for ``swarm --dashboard``: starts the dashboard, prints its URL."""
    from gossiploco.cli_dashboard import start_dashboard

    def start(bootstrap: list[str], key):
        running = start_dashboard(bootstrap, key, port=port)
        console.print(f"dashboard: {running.url}", highlight=False)
        return running

    return start


app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(data_app, name="data")

from gossiploco.cli_model import register as register_model_commands  # noqa: E402 - after the app exists

register_model_commands(app)

from gossiploco.cli_dashboard import register as register_dashboard_command  # noqa: E402 - after the app exists

register_dashboard_command(app)

from gossiploco.cli_analysis import register as register_analysis_commands  # noqa: E402 - after the app exists

register_analysis_commands(app)
