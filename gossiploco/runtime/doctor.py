"""``gossiploco doctor``: can this machine join a swarm? One ``Check`` per question, each with a fix.

Every check is a small function returning ``Check`` (or a list of them); the environment it
inspects (Python version, modules, the reachability checker) can be passed in, so tests fake it.
``run_doctor`` runs them in order: local ones first (Python, torch, torch.compile, packages, libzmq,
p2pd, ports),
then, with ``join``, the network ones: the bootstrap DHT node answers (a TCP probe of each
address, then a real DHT node joining through those that answered), the swarm key is the one
its bootstrap node holds (the beacon, ``DhtDirectory.confirm_swarm``), and this peer's own
reachability and clock skew as another node sees them (``gossiploco.reach.reachability``). Every
network wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MIN_PYTHON = (3, 11)
"""gossiploco.config reads presets with tomllib (Python 3.11+); pyproject.toml requires it too."""
STACK = ("gossiploco", "hivemind", "pyzmq", "msgpack", "numpy", "pynacl", "typer")
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 10.0
NTP_FIX = "enable NTP time sync: `sudo timedatectl set-ntp true` (Windows/macOS: turn on automatic date and time)"
PIP_FIX = "pip install -e .  (in gossiploco's checkout, inside your virtual environment)"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """"ok", "warn", "FAIL", or "skip" (not checked: the reason is in ``detail``)."""
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:  # the --json form
        return asdict(self)


def check_python(version: Sequence[int] = sys.version_info, where: str | None = None) -> Check:
    text = ".".join(str(v) for v in version[:3])
    detail = f"{text} ({platform.python_implementation()}) on {where or platform.platform()}"
    if tuple(version[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", "FAIL", f"{detail}: gossiploco needs Python {need} or newer",
                     f"install Python {need}+ (python.org, your OS packages, or `uv python install {need}`), "
                     f"make a virtual environment with it and reinstall gossiploco there")
    return Check("python", "ok", detail)


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version line, if this machine has one."""
    try:
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
        return found.group(1) if found else "present"
    except OSError:
        return "found (nvidia-smi)" if shutil.which("nvidia-smi") else None


def check_torch(torch: Any = None, nvidia: str | None | bool = False) -> list[Check]:
    """torch's version, and the device ``--device auto`` would train on (``nvidia=False``: look it up)."""
    if torch is None:
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            return [Check("torch", "FAIL", f"does not import: {type(exc).__name__}: {exc}",
                          "pip install torch  (https://pytorch.org/get-started/locally/ picks the build for your GPU)")]
    nvidia = _nvidia_driver() if nvidia is False else nvidia
    built_cuda = getattr(torch.version, "cuda", None)
    checks = [Check("torch", "ok", f"{torch.__version__} (built for CUDA {built_cuda})" if built_cuda
                    else f"{torch.__version__} (no CUDA in this build)")]
    install = "pip install torch --index-url https://download.pytorch.org/whl/cu121  (pick the CUDA version `nvidia-smi` shows)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        more = f" (+{torch.cuda.device_count() - 1} more)" if torch.cuda.device_count() > 1 else ""
        detail = f"cuda:0 {props.name}, {props.total_memory / 2**30:.1f} GiB{more}"
        try:  # a torch built for other GPU generations imports fine and fails at the first kernel
            torch.ones(1, device="cuda").add_(1).item()
            checks.append(Check("device", "ok", detail))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check("device", "FAIL", f"{detail}, but torch cannot run on it: {exc}"[:300], install))
    elif nvidia and not built_cuda:
        checks.append(Check("device", "warn", f"CPU only: this torch has no CUDA but the machine has an NVIDIA "
                                              f"driver ({nvidia}); training will be slow", install))
    elif nvidia:
        checks.append(Check("device", "warn", f"CPU only: torch is built for CUDA {built_cuda} but cannot use the "
                                              f"GPU (driver {nvidia}: too old for it?); training will be slow",
                            f"update the NVIDIA driver, or install the torch build for the driver's CUDA: {install}"))
    else:
        mps = getattr(getattr(torch.backends, "mps", None), "is_available", lambda: False)()
        checks.append(Check("device", "warn", "CPU only " + ("(Apple MPS is not used: gossiploco trains on CUDA or "
                                                             "CPU)" if mps else "(no CUDA GPU found)")
                            + ": training will be slow", "fine for tiny models; for real ones use a machine with an "
                            "NVIDIA GPU and the CUDA build of torch (https://pytorch.org/get-started/locally/)"))
    return checks


def check_compile(capability: tuple[int, int] | None = None, bf16: bool = False, triton: bool | None = None,
                  compiler: str | None | bool = False) -> Check:
    """Whether ``compute.compile = "auto"`` will compile here: on CUDA (``capability``: the GPU's compute
    capability) it needs Triton and a GPU Triton supports (7.0+; older ones train uncompiled, slower);
    on a CPU auto does not compile, and ``on`` would need a C++ compiler. Also says whether the GPU has
    bf16, the precision to train with on it. ``triton``/``compiler``: found or not (default: look)."""
    if capability is None:
        if compiler is False:
            compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        use = f"; `on` would use the C++ compiler {compiler}" if compiler else "; `on` needs a C++ compiler"
        return Check("compile", "ok", f"off on a CPU (compute.compile = auto){use}")
    if triton is None:
        triton = importlib.util.find_spec("triton") is not None
    precision = "bf16 yes: train with --set model.precision='\"bf16\"'" if bf16 else "no bf16 on this GPU: fp32"
    sm = f"sm{capability[0]}{capability[1]}"
    if not triton:
        return Check("compile", "warn", f"Triton is not installed: torch.compile cannot compile for the GPU, peers "
                     f"train uncompiled (slower); {precision}", "pip install triton  (the version your torch build names)")
    if capability < (7, 0):
        return Check("compile", "warn", f"{sm}: Triton needs compute capability 7.0 or newer, so peers train "
                     f"uncompiled (slower); {precision}", "use a newer GPU for full speed")
    return Check("compile", "ok", f"torch.compile with Triton on {sm}; {precision}")


def _compile_check() -> Check:
    try:
        import torch

        if torch.cuda.is_available():
            return check_compile(torch.cuda.get_device_capability(0), torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001 - check_torch reports an unusable torch
        pass
    return check_compile()


def check_packages(version_of: Callable[[str], str] = importlib.metadata.version) -> list[Check]:
    def one(name: str) -> Check:
        try:
            return Check(name, "ok", version_of(name))
        except importlib.metadata.PackageNotFoundError:
            return Check(name, "FAIL", "not installed", PIP_FIX)

    return [one(name) for name in STACK]


def check_zmq(zmq: Any = None) -> Check:
    """libzmq's version and CURVE support: every data-plane connection is CurveZMQ, so no CURVE, no peer."""
    if zmq is None:
        try:
            import zmq
        except Exception as exc:  # noqa: BLE001
            return Check("libzmq", "FAIL", f"pyzmq does not import: {exc}", PIP_FIX)
    detail = f"{zmq.zmq_version()} (pyzmq {zmq.pyzmq_version()})"
    if not zmq.has("curve"):
        return Check("libzmq", "FAIL", f"{detail} without CURVE encryption, which every peer connection uses",
                     "pip install --force-reinstall --only-binary=pyzmq pyzmq  (its wheels bundle a libzmq with "
                     "CURVE; a pyzmq built against the system libzmq needs one built with libsodium)")
    return Check("libzmq", "ok", f"{detail}, CURVE yes")


def check_p2pd(path: Path | None = None) -> Check:
    """hivemind's bundled ``p2pd`` daemon (every DHT node runs one)."""
    if path is None:
        try:
            import hivemind
        except Exception as exc:  # noqa: BLE001
            return Check("p2pd", "FAIL", f"hivemind does not import: {type(exc).__name__}: {exc}", PIP_FIX)
        path = Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"
    if not path.is_file():
        return Check("p2pd", "FAIL", f"{path} is missing", "pip install --force-reinstall hivemind  (where no wheel "
                                                           "has p2pd, build hivemind from source: it needs Go)")
    executable = os.access(path, os.X_OK)
    return Check("p2pd", "ok" if executable else "FAIL", f"{path}" + ("" if executable else " is not executable"),
                 "" if executable else f"chmod +x {path}")


def check_port(host: str, port: int, name: str = "data port", flag: str = "--port") -> Check:
    """Whether ``host:port`` can be bound now (port 0: whether binding any port works)."""
    what = f"{host}:{port}" if port else f"{host} (any free port)"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq and p2pd bind
            sock.bind((host, port))
            bound = sock.getsockname()[1]
    except socket.gaierror as exc:
        return Check(name, "FAIL", f"cannot resolve --host {host}: {exc}", "give --host a numeric address of "
                     "this machine (0.0.0.0: every interface)")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fix = (f"port {port} is taken by another program: stop it (`ss -ltnp 'sport = :{port}'` or "
                   f"`lsof -i :{port}` shows which), or pick another with {flag} N (0: any free port)")
        elif exc.errno in (errno.EACCES, errno.EPERM):
            fix = f"ports below 1024 need root: pick {flag} 1024 or higher"
        elif exc.errno == errno.EADDRNOTAVAIL:
            fix = f"{host} is not an address of this machine: use --host 0.0.0.0 (every interface) or one of its own"
        else:
            fix = f"pick another {flag}, or --host 0.0.0.0"
        return Check(name, "FAIL", f"cannot listen on {what}: {exc.strerror or exc}", fix)
    return Check(name, "ok", f"{what} can be bound" + ("" if port else f" (got {bound})"))


def split_join(join: Sequence[str] | None) -> list[str]:
    """``--join`` values, repeatable and comma-separated, as one list."""
    return [a.strip() for item in join or [] for a in item.split(",") if a.strip()]


def _probe(address: str, timeout_s: float) -> str | None:
    """None if the address's host:port accepts a TCP connection, else why not."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        maddr = Multiaddr(address)
        host = next(maddr[p] for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in maddr.protocols())
        port = int(maddr["tcp"])
    except Exception:  # noqa: BLE001 - multiaddr raises a zoo of types
        return "not an /ip4, /ip6 or /dns address with /tcp/PORT"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def check_join(join: Sequence[str], swarm_key: str | None, timeout_s: float) -> list[Check]:
    """The bootstrap answers (TCP, then a DHT node of our own joins through it) and holds ``swarm_key``."""
    from gossiploco.errors import GossiplocoError, UnsafeKeyFile
    from gossiploco.membership.dht_node import check_initial_peers
    from gossiploco.membership.dht_directory import DhtDirectory

    trust = key = None
    if swarm_key:  # a local file first: an unusable one is named before anything is asked of the network
        from gossiploco.security.identity import Identity
        from gossiploco.security.swarm_key import SwarmKey
        from gossiploco.security.trust import Trust

        try:
            key = SwarmKey.load(swarm_key)
        except GossiplocoError as exc:
            return [Check("swarm key", "FAIL", str(exc), exc.fix if isinstance(exc, UnsafeKeyFile)
                          else "pass the run's swarm key file, or the gsk1-... text `gossiploco dht` printed")]
        trust = Trust(Identity.generate(), key)
    fix_copy = "copy the whole address `gossiploco dht` printed: /ip4/HOST/tcp/PORT/p2p/PEER_ID"
    try:
        addresses = check_initial_peers(split_join(join))
    except GossiplocoError as exc:
        return [Check("dht bootstrap", "FAIL", str(exc), fix_copy)]
    with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
        failed = dict(zip(addresses, pool.map(lambda a: _probe(a, timeout_s), addresses)))
    answered = [a for a, why in failed.items() if why is None]
    silent = "; ".join(f"{a}: {why}" for a, why in failed.items() if why is not None)
    if not answered:
        return [Check("dht bootstrap", "FAIL", f"no bootstrap address answered ({silent})",
                      "check that `gossiploco dht` is running there, that the address is its current one, and that "
                      "its TCP port is open to this machine (firewall, port forwarding, the right public IP)")]
    started = time.monotonic()
    try:
        directory = DhtDirectory("doctor", initial_peers=answered, timeout_s=timeout_s, trust=trust)
    except GossiplocoError as exc:
        return [Check("dht bootstrap", "FAIL", f"TCP answered at {', '.join(answered)} but joining the DHT failed: "
                                               f"{exc}", "is the /p2p/ peer id current? A bootstrap node restarted "
                                                         "without --identity has a new one: ask for its new address")]
    try:
        checks = [Check("dht bootstrap", "warn" if silent else "ok",
                        f"joined the DHT through {', '.join(answered)} in {time.monotonic() - started:.1f} s"
                        + (f"; no answer from {silent}" if silent else ""),
                        "drop the addresses that did not answer, or check those bootstrap nodes" if silent else "")]
        if key is None:
            checks.append(Check("swarm key", "skip", "not checked: give --swarm-key to confirm it"))
        else:
            try:
                directory.confirm_swarm()
                checks.append(Check("swarm key", "ok", f"{key.fingerprint}: the bootstrap node holds the same key"))
            except GossiplocoError as exc:
                checks.append(Check("swarm key", "FAIL", str(exc), "use the key the run's `gossiploco dht` printed "
                                                                   "(or its key file)"))
    finally:
        directory.close()
    return checks


def _bounded(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()`` in a daemon thread; TimeoutError past ``timeout_s`` (the thread is left behind)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=target, name="doctor-reachability", daemon=True).start()
    return future.result(timeout_s)


def check_reachability(join: Sequence[str], port: int, timeout_s: float,
                       reachability: Callable[..., Any] | None = None) -> list[Check]:
    """This peer's reachability and clock skew as a node of the swarm sees them. Only a checker that
    dialled gives a verdict; when none did (busy, refusing, unreachable) it is "unknown", a warning."""
    from gossiploco.reach.reachability import check_bound_s

    if reachability is None:
        from gossiploco.reach.reachability import check_reachability as reachability
    try:
        # the check returns within check_bound_s on its own; this only guards against a hang
        r = _bounded(lambda: reachability(split_join(join), port, timeout_s=timeout_s), check_bound_s(timeout_s) + 15)
    except Exception as exc:  # noqa: BLE001 - a broken check is a warning, not a verdict
        return [Check("reachability", "warn", f"check failed: {type(exc).__name__}: {exc}",
                      "try again; if it persists, peers still use reverse connections and relays"),
                Check("clock", "skip", "not checked: the reachability check failed")]
    seen = f" (seen from {r.observed_ip})" if r.observed_ip else ""
    if r.reachable:
        reach = Check("reachability", "ok", f"reachable at {r.address}{seen}")
    elif r.reachable is False:
        reach = Check("reachability", "ok", f"behind NAT{seen}: peers will use reverse connections and relays; "
                                            f"nothing to do ({r.detail})")
    else:
        count = r.no_verdict
        reach = Check("reachability", "warn",
                      f"unknown ({count} checker{'s' if count != 1 else ''} busy/unreachable): {r.detail}",
                      "try again later (a checker may be busy or under attack); meanwhile a peer acts as behind "
                      "NAT (reverse connections and relays). If this machine is reachable, --reachability public "
                      "--announce HOST[:PORT] skips the check; to become reachable, forward a TCP port N to this "
                      "machine and pass --port N --announce PUBLIC_IP")
    skew = r.clock_skew_s
    if skew is None:
        clock = Check("clock", "skip", "not checked: no node reported its clock")
    else:
        text = f"{skew + 0.0 if abs(skew) >= 0.005 else 0.0:+.2f} s from {r.checker or 'the checker'}'s clock"
        status = "FAIL" if abs(skew) > SKEW_FAIL_S else "warn" if abs(skew) > SKEW_WARN_S else "ok"
        clock = Check("clock", status, text + ("" if status == "ok" else
                                               ": DHT records expire by wall clock, so peers would drop them"),
                      "" if status == "ok" else NTP_FIX)
    return [reach, clock]


def run_doctor(*, join: Sequence[str] | None = None, host: str = "0.0.0.0", port: int = 0, dht_port: int | None = None,
               swarm_key: str | None = None, timeout_s: float | None = None,
               reachability: Callable[..., Any] | None = None) -> list[Check]:
    """Every check, in order. ``timeout_s`` (default: a peer's own deadline for joining the DHT, hello_s + 5)
    bounds each network wait. ``reachability``: ``gossiploco.reach.reachability.check_reachability`` or a fake."""
    if timeout_s is None:
        from gossiploco.config import TimeoutConfig

        timeout_s = TimeoutConfig().hello_s + 5
    checks = [check_python(), *check_torch(), _compile_check(), *check_packages(), check_zmq(), check_p2pd()]
    data = check_port(host, port)
    checks.append(data)
    if dht_port is not None:
        if dht_port and dht_port == port:
            checks.append(Check("dht port", "FAIL", f"--dht-port {dht_port} is also --port",
                                "give the DHT node and the data plane different ports"))
        else:
            checks.append(check_port(host, dht_port, "dht port", "--dht-port"))
    if not split_join(join):
        checks.append(Check("dht bootstrap", "skip", "not checked: give --join ADDR (from `gossiploco dht`)"
                            + (" to check --swarm-key too" if swarm_key else "")))
        return checks
    network = check_join(join, swarm_key, timeout_s)
    checks += network
    if not any(c.name == "dht bootstrap" for c in network):  # the swarm key failed before the network was asked
        checks.append(Check("reachability", "skip", "not checked: fix --swarm-key first"))
    elif any(c.name == "dht bootstrap" and c.status == "FAIL" for c in network):
        checks.append(Check("reachability", "skip", "not checked: no bootstrap node to ask"))
    elif data.status == "FAIL":
        checks.append(Check("reachability", "skip", "not checked: the data port is not free"))
    else:
        checks += check_reachability(join, port, timeout_s, reachability)
    return checks


def summary(checks: Sequence[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL", "skip")}
    verdict = "problems to fix before joining (see fix: lines)" if counts["FAIL"] else "ready to join"
    return (f"{counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL, {counts['skip']} not checked: "
            f"{verdict}")


def format_checks(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:5s} {c.name:{width}s}  {c.detail}")
        if c.fix:
            lines.append(f"{'':5s} {'':{width}s}  fix: {c.fix}")
    return "\n".join(lines)
