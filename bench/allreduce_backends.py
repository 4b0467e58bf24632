"""The peer-process side of ``bench/allreduce.py``: each peer's input and its share of the result check, the
backends' runners (zmq and its inplace, encrypted and compressed variants, gloo, hivemind) and ``peer_main``,
the function every spawned peer process runs; also the ZmqExchange options the zmq backends get from the
command line (``zmq_kwargs``).

The driver (``bench/allreduce.py``) and the report (``bench/allreduce_report.py``) import from here; this
module imports neither."""

from __future__ import annotations

import contextlib
import os
import time
import traceback

from testbed.spawned import (
    become_session_leader, close_within, cpu_seconds, finish, load_impl, proc_status, reset_peak_rss, thread_cpu,
    thread_cpu_delta,
)

GEN_CHUNK = 1 << 22  # elements per independently seeded randn chunk
CURVE_SUFFIX = "-curve"
CURVEZMQ_SUFFIX = "-curvezmq"


def zmq_kwargs(args) -> dict:
    kw = {}
    if args.chunk_bytes:
        kw["chunk_bytes"] = args.chunk_bytes
    if args.max_message_bytes:
        kw["max_message_bytes"] = args.max_message_bytes
    if args.io_threads:
        kw["io_threads"] = args.io_threads
    if args.stripes:
        kw["stripes"] = args.stripes
    return kw


# -- inputs and checks ---------------------------------------------------------------------------

def chunk_seed(rank: int, rep: int, chunk: int) -> int:
    return ((rank + 1) * 1_000_003 + rep) * 1_000_003 + chunk


def random_chunk(rank: int, rep: int, chunk: int, n: int, out=None):
    import torch

    g = torch.Generator().manual_seed(chunk_seed(rank, rep, chunk))
    return torch.randn(n, generator=g) if out is None else torch.randn(n, generator=g, out=out)


def fill_random(x, rank: int, rep: int) -> None:
    """Rank ``rank``'s input of repetition ``rep``, written into the 1-d tensor ``x``."""
    total = x.numel()
    for c, start in enumerate(range(0, total, GEN_CHUNK)):
        random_chunk(rank, rep, c, min(GEN_CHUNK, total - start), out=x[start:start + GEN_CHUNK])


def check_result(result, world: int, rank: int, rep: int, total: int) -> dict:
    """This peer's share of the result check: the max abs error against the exact mean (float64
    sum of all ranks' regenerated inputs / world) over the chunks c with c % world == rank (the
    peers' shares cover every element once), and a float64 checksum of every chunk of its whole
    result, which the driver compares across peers (each chunk against the peer that checked it)."""
    import torch

    flat = result.reshape(-1)
    if flat.numel() != total or flat.dtype != torch.float32:
        raise AssertionError(f"result has {flat.numel()} {flat.dtype} elements, expected {total} float32")
    worst, sums = 0.0, []
    for c, start in enumerate(range(0, total, GEN_CHUNK)):
        n = min(GEN_CHUNK, total - start)
        mine = flat[start:start + n]
        sums.append(float(mine.sum(dtype=torch.float64)))
        if c % world != rank:
            continue
        acc = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            acc += random_chunk(r, rep, c, n)
        acc /= world
        err = float((mine.double() - acc).abs().max())
        worst = max(worst, err if err == err else float("inf"))  # NaN counts as a failure
    return {"max_err": worst, "sums": sums}


# -- backends (inside the peer processes) ----------------------------------------------------------

class ZmqPeer:
    inplace = False
    curve = False
    sealed = True
    """With ``curve``: data chunks sealed with AES-GCM on the sealed port (False: CurveZMQ alone)."""

    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        cls = load_impl(cfg["zmq_impl"])
        self.world = world
        suffix = "" if not self.curve else CURVE_SUFFIX if self.sealed else CURVEZMQ_SUFFIX
        kind = getattr(self, "backend", "") or ("zmq-inplace" if self.inplace else "zmq") + suffix
        kwargs = dict(cfg["zmq_kwargs"])
        if self.curve:  # CurveZMQ with a static list's identities, derived from the run's swarm key
            from gossiploco.security.swarm_key import SwarmKey
            from gossiploco.security.trust import Trust

            kwargs["trust"] = Trust.static(SwarmKey.parse(cfg["swarm_key"]), rank, world)
            if not self.sealed:
                kwargs["sealed_port"] = None
        self.ex = cls(rank, cfg["endpoints"][kind], f"{cfg['run_id']}-{kind}", cfg["timeout_s"], **kwargs)
        if not self.ex.wait_connected(cfg["timeout_s"]):
            self.ex.close()
            raise RuntimeError(f"rank {rank}: zmq peers did not connect within {cfg['timeout_s']}s")

    def prepare(self, x, rep: int) -> None:
        self.x = x

    def run(self, rep: int):
        kwargs = {"inplace": True} if self.inplace else {}
        return self.ex.all_reduce_mean(f"mix1/{rep}", self.x, list(range(self.world)), **kwargs)

    def close(self) -> None:
        self.ex.close()


class ZmqInplacePeer(ZmqPeer):
    """``all_reduce_mean(..., inplace=True)``: the exchange reduces in the caller's tensor."""

    inplace = True


class ZmqCurvePeer(ZmqPeer):
    """The copying API over CurveZMQ (``trust=Trust.static``)."""

    curve = True


class ZmqInplaceCurvePeer(ZmqInplacePeer):
    """``inplace=True`` encrypted (``trust=Trust.static``): the data plane as ``gossiploco peer`` runs it."""

    curve = True


class ZmqCurveZmqPeer(ZmqCurvePeer):
    """The copying API over CurveZMQ alone (no sealed port)."""

    sealed = False


class ZmqInplaceCurveZmqPeer(ZmqInplaceCurvePeer):
    """``inplace=True`` over CurveZMQ alone (no sealed port): every byte through libzmq's XSalsa20-Poly1305."""

    sealed = False


class ZmqCompressedPeer(ZmqPeer):
    """The compressed group mean of ``mix2.compression`` (``group_mean``: quantized reduce-scatter by direct
    sends, then a quantized all-gather) over the same exchange, fp32 sums."""

    inplace = True
    compression = ""

    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        from gossiploco.mixing.compression import build_codec

        super().__init__(rank, world, cfg, info_q)
        self.codec = build_codec(self.compression)

    def run(self, rep: int):
        from gossiploco.mixing.compressed import group_mean

        return group_mean(f"mix2/{rep}", self.x, list(range(self.world)), self.ex, self.codec, inplace=True)[0]


class ZmqInt8Peer(ZmqCompressedPeer):
    compression, backend = "int8", "zmq-int8"


class Zmq4bitPeer(ZmqCompressedPeer):
    compression, backend = "4bit", "zmq-4bit"


class GlooPeer:
    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        from datetime import timedelta

        import torch.distributed as dist

        self.dist, self.world = dist, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))

    def prepare(self, x, rep: int) -> None:
        self.x = x

    def run(self, rep: int):
        self.dist.all_reduce(self.x)  # sum, in place
        self.x.div_(self.world)
        return self.x

    def close(self) -> None:
        self.dist.destroy_process_group()


class HivemindPeer:
    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        import multiprocessing

        # A spawn child inherits the spawn start method; hivemind's helper processes expect fork.
        multiprocessing.set_start_method("fork", force=True)
        import hivemind
        import torch

        self.timeout_s = cfg["timeout_s"]
        self.matchmaking_s = cfg["hivemind_matchmaking_s"]
        host = ["/ip4/127.0.0.1/tcp/0"]
        if rank == 0:
            self.dht = hivemind.DHT(start=True, host_maddrs=host)
            maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
            for _ in range(world - 1):
                info_q.put(maddrs)
        else:
            maddrs = info_q.get(timeout=self.timeout_s)
            self.dht = hivemind.DHT(start=True, host_maddrs=host, initial_peers=maddrs)
        self.averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(cfg["values"])], self.dht, start=True, prefix="bench_allreduce",
            target_group_size=world, min_group_size=world, min_matchmaking_time=self.matchmaking_s,
            request_timeout=min(3.0, self.matchmaking_s / 2), allreduce_timeout=self.timeout_s, next_chunk_timeout=30.0,
            shutdown_timeout=5)
        self.control = None

    def prepare(self, x, rep: int) -> None:
        from hivemind.averaging.control import AveragingStage

        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(x)
        self.control = self.averager.step(wait=False, require_trigger=True, timeout=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while self.control.stage != AveragingStage.AWAITING_TRIGGER:
            if self.control.done():
                self.control.result(timeout=0)  # raises the step's failure
                raise RuntimeError("hivemind step finished before the trigger")
            if time.monotonic() > deadline:
                raise TimeoutError(f"hivemind matchmaking did not finish within {self.timeout_s}s")
            time.sleep(0.005)

    def run(self, rep: int):
        self.control.allow_allreduce()
        self.control.result(timeout=self.timeout_s)
        with self.averager.get_tensors() as tensors:
            return tensors[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.averager.shutdown()
        with contextlib.suppress(Exception):
            self.dht.shutdown()


BACKENDS = {"zmq": ZmqPeer, "zmq-inplace": ZmqInplacePeer, "zmq-curve": ZmqCurvePeer,
            "zmq-inplace-curve": ZmqInplaceCurvePeer, "zmq-curvezmq": ZmqCurveZmqPeer,
            "zmq-inplace-curvezmq": ZmqInplaceCurveZmqPeer, "zmq-int8": ZmqInt8Peer, "zmq-4bit": Zmq4bitPeer,
            "gloo": GlooPeer, "hivemind": HivemindPeer}


def peer_main(rank: int, world: int, cfg: dict, barrier, results, info_q, extra) -> None:
    """One peer: set up every backend of ``cfg["kinds"]``, then warm-up + timed repetitions."""
    become_session_leader()
    peers: dict = {}
    try:
        import torch

        if cfg["threads"]:  # else torch's default, one per core: what a peer process runs
            torch.set_num_threads(cfg["threads"])
        for kind in cfg["kinds"]:
            start = time.monotonic()
            peers[kind] = BACKENDS[kind](rank, world, cfg, info_q)
            results.put(("ready", rank, {"backend": kind, "setup_s": time.monotonic() - start}))
        x = torch.empty(cfg["values"], dtype=torch.float32)
        t_wait = cfg["timeout_s"]
        for rep in range(cfg["warmup"] + cfg["reps"]):
            order = cfg["kinds"] if rep % 2 == 0 else cfg["kinds"][::-1]
            for kind in order:
                peer = peers[kind]
                fill_random(x, rank, rep)
                barrier.wait(t_wait)
                peer.prepare(x, rep)
                base = reset_peak_rss(trim=cfg["trim"])
                barrier.wait(t_wait)
                threads0 = thread_cpu() if os.environ.get("BENCH_THREADS") else None
                cpu0, t0 = cpu_seconds(), time.monotonic()
                out = peer.run(rep)
                t1, cpu1 = time.monotonic(), cpu_seconds()
                peak = proc_status("VmHWM")
                if threads0 is not None and rank == 0:
                    print(f"{kind} rank 0 rep {rep} threads: {thread_cpu_delta(threads0, thread_cpu())}", flush=True)
                check = check_result(out, world, rank, rep, cfg["values"]) if cfg["verify"] else \
                    {"max_err": 0.0, "sums": []}
                del out
                results.put(("rep", rank, {"backend": kind, "rep": rep, "t0": t0, "t1": t1, "rss_base": base,
                                           "rss_peak": peak, "cpu_s": cpu1 - cpu0, **check}))
        barrier.wait(t_wait)  # nobody closes while another still exchanges
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, which kills the group
        results.put(("error", rank, traceback.format_exc()))
        finish(results, 1)
    # "done" goes out before close(): a close() that hangs must not cost the measurements.
    results.put(("done", rank, None))
    closed = [kind for kind, peer in peers.items() if close_within(peer.close, cfg["close_timeout_s"])]
    results.put(("closed", rank, closed))
    finish(results, 0)
