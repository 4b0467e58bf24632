"""The ``gossiploco`` command line. Each command fills a config, builds the runtime, runs it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gossiploco.cli_options import (CONFIG, DATA, DEVICE, INNER_STEPS, MODEL, RESUME, ROUNDS, SEED, SETS, WORKERS, console,
                                    fail, training_overrides)
from gossiploco.cli_report import (PlainProgress, print_summary, print_swarm_summary, progress_line, progress_table,
                                   slowest_round)
from gossiploco.cli_tokenizer import tokenizer_app
from gossiploco.errors import ConfigError, GossiplocoError
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
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory: metrics.jsonl, summary.json, model, checkpoints/ (default runs/simulate, or runs/simulate-N when that holds a run)."),
    resume: bool = RESUME,
    set_: Optional[list[str]] = SETS,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Run M workers of Factored Gossip DiLoCo in one process (the virtual swarm)."""
    from gossiploco.config import load_config
    from gossiploco.metrics import MetricsSink
    from gossiploco.runtime.run_dir import output_dir, resume_checkpoint
    from gossiploco.runtime.virtual import VirtualSwarm
    from gossiploco.tokenizer import load_tokenizer, save_tokenizer_copy

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config, training_overrides(workers=workers, inner_steps=inner_steps, rounds=rounds, seed=seed,
                                                     model=model, device=device, data=data, sets=set_))
        out = output_dir(out, Path("runs/simulate"), resume)
        checkpoint = resume_checkpoint(out, cfg.to_dict()) if resume else None
        save_tokenizer_copy(load_tokenizer(cfg.data.tokenizer), out)  # OUT/tokenizer.json: the model's tokenizer
        swarm = VirtualSwarm(cfg)
        if checkpoint is not None:
            swarm.resume(checkpoint)
        sink = MetricsSink(out, resume_bytes=checkpoint.meta["metrics_bytes"] if checkpoint else (0 if resume else None))
    except GossiplocoError as exc:
        fail(exc)
    writer = checkpoint_writer(cfg, out)
    if checkpoint is not None:
        console.print(f"resuming {out} at round {checkpoint.round} from {checkpoint.path.name}")
    console.print(
        f"[bold]{cfg.name}[/]: {cfg.workers} workers x {cfg.rounds} rounds x {cfg.inner_steps} inner steps, "
        f"model {cfg.model.size}, {swarm.corpus.description}, device {swarm.device}"
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
            result = swarm.run(sink, on_step, writer)
        except KeyboardInterrupt:
            sink.write_summary({**swarm.summary_so_far(), "run_config": cfg.to_dict()})
            sink.close()
            progress.stop()
            exit_stopped("simulate", stop_checkpoints(writer, out, interrupted=True))
    stop_checkpoints(writer, out, interrupted=False)
    result.summary.update(run_config=cfg.to_dict(), **(writer.stats() if writer is not None else {}))
    sink.write_summary(result.summary)
    sink.close()
    from gossiploco.model_file import save_model

    model_path = save_model(result.final_params, out, cfg.to_dict())
    print_summary([result.summary])
    console.print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}  model: {model_path}")


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
    dht_port: int = typer.Option(0, "--dht-port", help="With --join: TCP port of this peer's own DHT node (0: any; give one, forwarded, with --announce behind NAT)."),
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
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default runs/peer-RANK)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Run id (default: preset name + digest of the config)."),
    set_: Optional[list[str]] = SETS,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and the final table."),
) -> None:
    """Run one peer: it joins a run through a DHT bootstrap address (--join) or a static list (--peers) and mixes over ZeroMQ."""
    import faulthandler
    import signal

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = None
    try:
        from gossiploco.config import load_config
        from gossiploco.metrics import MetricsSink
        from gossiploco.runtime.dht_peer import joined_peer
        from gossiploco.runtime.peer import NetworkPeer, run_id_for
        from gossiploco.security.options import peer_trust, swarm_key_option

        if bool(join) == bool(peers):
            raise ConfigError("--join", "give either --join BOOTSTRAP_MULTIADDR (the DHT) or --peers LIST (a static list)")
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
        cfg = load_config(config, training_overrides(workers=workers, inner_steps=inner_steps, rounds=rounds, seed=seed,
                                                     model=model, device=device, data=data, sets=set_))
        if join:
            trust = peer_trust(swarm, identity_file=identity or (out or Path("runs")) / "identity.key")
            node = joined_peer(cfg, trust, rank, join, host, port, announce, run_id or run_id_for(cfg), dht_port,
                               relays=relay or [], reachability=reachability, new_run=new_run)
            rank = trust.peer_id
        else:
            node = NetworkPeer(cfg, rank, endpoints, run_id=run_id,
                               trust=peer_trust(swarm, static_rank=rank, static_count=len(endpoints)))
    except GossiplocoError as exc:
        fail(exc)
    except KeyboardInterrupt:  # during start-up (loading data, starting the DHT node): nothing to keep
        if node is not None:
            node.close()
        exit_stopped("peer", "during start-up")
    out = out or Path(f"runs/peer-{rank}")
    try:
        from gossiploco.runtime.run_dir import output_dir, resume_checkpoint
        from gossiploco.tokenizer import load_tokenizer, save_tokenizer_copy

        output_dir(out, out, resume)  # never over a run without --resume
        checkpoint = resume_checkpoint(out, cfg.to_dict()) if resume else None
        save_tokenizer_copy(load_tokenizer(cfg.data.tokenizer), out)  # OUT/tokenizer.json: the model's tokenizer
        if checkpoint is not None:
            node.resume(checkpoint)
            console.print(f"resuming {out} at round {checkpoint.round} from {checkpoint.path.name}")
        sink = MetricsSink(out, resume_bytes=checkpoint.meta["metrics_bytes"] if checkpoint else (0 if resume else None))
    except GossiplocoError as exc:
        node.close()
        fail(exc)
    writer = checkpoint_writer(cfg, out)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    console.print(f"[bold]{cfg.name}[/] peer {rank} at {node.endpoint}: {cfg.rounds} rounds x "
                  f"{cfg.inner_steps} inner steps, model {cfg.model.size}, device {node.device}, run {node.run_id}")

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
        result = node.run(sink, on_record, writer)
    except KeyboardInterrupt:
        if _forget_unstarted_run(sink, out, resume):
            stop_checkpoints(writer, out, interrupted=False)  # nothing was submitted: this only stops its thread
            exit_stopped("peer", f"before the first round: nothing kept in {out}")
        sink.write_summary({**node.summary_so_far(), "run_config": cfg.to_dict()})
        sink.close()
        exit_stopped("peer", stop_checkpoints(writer, out, interrupted=True))
    except GossiplocoError as exc:
        sink.close()
        stop_checkpoints(writer, out, interrupted=False)
        _forget_unstarted_run(sink, out, resume)
        fail(exc)
    stop_checkpoints(writer, out, interrupted=False)
    result.summary.update(run_config=cfg.to_dict(), **(writer.stats() if writer is not None else {}))
    sink.write_summary(result.summary)
    sink.close()
    from gossiploco.model_file import save_model

    model_path = save_model(result.final_params, out, cfg.to_dict())
    print_summary([result.summary])
    console.print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}  model: {model_path}")


def _forget_unstarted_run(sink, out: Path, resume: bool) -> bool:
    """A peer stopped before its first record (refused at start, or Ctrl+C while it waited for the others, to
    restart it with other settings) leaves no run in ``out``, so the corrected command may use it again. True
    when it removed it."""
    if resume or sink.records:
        return False
    sink.close()
    (out / "metrics.jsonl").unlink(missing_ok=True)
    return True


def checkpoint_writer(cfg, out: Path):
    """The run's checkpoint writer (None with ``checkpoint.enabled = false``)."""
    from gossiploco.checkpoint import CheckpointWriter, run_checkpoints

    return CheckpointWriter(run_checkpoints(out), cfg.to_dict(), cfg.checkpoint.keep) if cfg.checkpoint.enabled else None


def stop_checkpoints(writer, out: Path, interrupted: bool) -> str | None:
    """Finish writing checkpoints (a second Ctrl+C abandons the one being written: the previous one stays); for an
    interrupted run, return how to continue it (the detail of the stop line, ``runtime.stopping``)."""
    if writer is None:
        if interrupted:
            return f"checkpoints are off (checkpoint.enabled = false): metrics so far are in {out / 'metrics.jsonl'}"
        return None
    try:
        writer.close()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted again[/]: the checkpoint being written was abandoned")
    if writer.failures:
        console.print(f"[bold red]{writer.failures} checkpoint(s) could not be written[/] (see the errors above)")
    if interrupted:
        from gossiploco.checkpoint import checkpoint_files, run_checkpoints

        files = checkpoint_files(run_checkpoints(out))
        last = files[0].name if files else "none"
        return (f"newest checkpoint: {last} in {out / 'checkpoints'}; continue with the same command plus "
                f"--resume --out {out}")
    return None


@app.command()
@stops_cleanly("keygen")
def keygen(out: Path = typer.Option(..., "--out", "-o", help="File to write the new swarm key to (mode 0600); never overwritten.")) -> None:
    """Write a new swarm key: the secret that makes a run private. Give it to every peer (--swarm-key)."""
    from gossiploco.security.swarm_key import SwarmKey

    if out.exists():
        fail(ConfigError("--out", f"{out} exists; a swarm key is never overwritten (remove it first)"))
    key = SwarmKey.generate()
    key.save(out)
    console.print(f"swarm key {key.fingerprint} written to {out}; peers join with --swarm-key {out}")


@app.command()
@stops_cleanly("dht")
def dht(
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on."),
    port: int = typer.Option(0, "--port", help="TCP port (0: any free one; give a fixed one for an address that survives restarts)."),
    announce: Optional[list[str]] = typer.Option(None, "--announce", help="Multiaddr to advertise instead, e.g. /ip4/PUBLIC_IP/tcp/PORT (behind NAT or a forwarded port); repeatable."),
    identity: Optional[Path] = typer.Option(None, "--identity", help="Private key file: keeps the same peer id (and so the same multiaddrs) across restarts; created if missing."),
    swarm_key: Path = typer.Option(Path("swarm.key"), "--swarm-key", help="The run's swarm key file: used if it exists, else created (mode 0600)."),
    open_run: bool = typer.Option(False, "--open", help="A public run: no swarm key; records are still signed."),
    join: Optional[list[str]] = typer.Option(None, "--join", help="Join an existing run's DHT (another bootstrap multiaddr): a second bootstrap node and relay for peers behind NAT; repeatable."),
    relay_data_mb: float = typer.Option(4096.0, "--relay-data-mb", help="Relaying for peers behind NAT: MiB per direction one relayed connection may carry before it is reset (peers renew theirs before)."),
    relay_time_s: float = typer.Option(1800.0, "--relay-time-s", help="Relaying: the longest life of one relayed connection, in seconds."),
) -> None:
    """Run a bootstrap DHT node (which also relays for peers behind NAT) for peers to --join; prints a paste-ready join command; Ctrl+C stops it."""
    from gossiploco.membership.bootstrap import serve_bootstrap
    from gossiploco.security.swarm_key import SwarmKey

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = None
    try:
        if not open_run:
            key = SwarmKey.load(swarm_key) if swarm_key.exists() else SwarmKey.generate()
            if not swarm_key.exists():
                key.save(swarm_key)
                console.print(f"created swarm key {key.fingerprint} in {swarm_key}")
    except GossiplocoError as exc:
        fail(exc)

    def ready(addresses: list[str]) -> None:
        console.print("[bold]bootstrap DHT node ready.[/] "
                      + ("Public run: anyone can join." if key is None else
                         f"Private run (swarm key {key.fingerprint}): the command carries the key, share it "
                         f"privately (or copy {swarm_key} and pass --swarm-key FILE)."))
        secret = "--open" if key is None else f"--swarm-key {key.text}"
        for address in addresses:
            print(f"  gossiploco peer --config PRESET --join {address} {secret}", flush=True)

    try:
        serve_bootstrap(host, port, announce, identity, on_ready=ready, swarm=key, open_run=open_run, join=join or [],
                        relay_limits=(relay_data_mb * (1 << 20), relay_time_s))
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
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory: summary.json plus peer-I/ (metrics, summary, model, checkpoints) and peer-I.log (default runs/swarm, or runs/swarm-N when that holds a run)."),
    resume: bool = typer.Option(False, "--resume", help="Restart a stopped swarm: every peer continues from its newest checkpoint in --out (default: the newest runs/swarm*)."),
    set_: Optional[list[str]] = SETS,
    dashboard: bool = typer.Option(False, "--dashboard", help="Also serve a live web dashboard of the swarm (gossiploco dashboard) and print its URL."),
    dashboard_port: int = typer.Option(8080, "--dashboard-port", help="With --dashboard: TCP port of the page (on 127.0.0.1)."),
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
                                                     model=model, device=device, data=data, sets=set_))
        from gossiploco.runtime.run_dir import output_dir

        out = output_dir(out, Path("runs/swarm"), resume)
    except GossiplocoError as exc:
        fail(exc)
    args = ["--config", config, "--run-id", run_id_for(cfg), "--quiet"] + (["--resume"] if resume else [])
    for flag, value in (("--inner-steps", inner_steps), ("--rounds", rounds), ("--seed", seed), ("--model", model),
                        ("--device", device)):
        if value is not None:
            args += [flag, str(value)]
    for path in data or []:
        args += ["--data", path]
    for item in set_ or []:
        args += ["--set", item]
    console.print(f"[bold]{cfg.name}[/]: {peers} peers x {cfg.rounds} rounds x {cfg.inner_steps} inner steps, model "
                  f"{cfg.model.size}; peers run `gossiploco peer {shlex.join(args)} --join BOOTSTRAP`; logs in {out}/")
    local = LocalSwarm(peers, out, args, on_bootstrap=_swarm_dashboard(dashboard_port) if dashboard else None)
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

from gossiploco.cli_model import register as register_model_commands  # noqa: E402 - after the app exists

register_model_commands(app)

from gossiploco.cli_dashboard import register as register_dashboard_command  # noqa: E402 - after the app exists

register_dashboard_command(app)

from gossiploco.cli_analysis import register as register_analysis_commands  # noqa: E402 - after the app exists

register_analysis_commands(app)
