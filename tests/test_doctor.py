"""``gossiploco doctor``: each check against fakes, then the command as a user runs it."""

from __future__ import annotations

import importlib.metadata
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from gossiploco.cli import app
from gossiploco.reach.reachability import Reachability
from gossiploco.runtime import doctor
from gossiploco.runtime.doctor import Check
from gossiploco.runtime.launch import free_ports

# A well-formed libp2p peer id (nobody of ours has it), for addresses nobody answers at.
SOME_PEER_ID = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def reach(reachable=True, skew=0.1, detail="dialed back"):
    """A fake ``check_reachability`` answering with the given outcome; records its calls."""
    calls = []

    def check(join, port, *, timeout_s):
        calls.append((list(join), port, timeout_s))
        return Reachability(reachable, "tcp://198.51.100.7:4000" if reachable else None,
                            "198.51.100.7" if reachable is not None else None, detail, "12D3KooWchecker", skew, 0.01,
                            no_verdict=2 if reachable is None else 0)

    check.calls = calls
    return check


def test_python_too_old_fails_with_a_fix():
    check = doctor.check_python((3, 9, 18), "Linux")
    assert check.status == "FAIL" and "3.9.18" in check.detail and "3.11" in check.fix
    assert doctor.check_python((3, 12, 1), "Linux").status == "ok"


def test_port_taken_fails_naming_the_port_and_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check = doctor.check_port("127.0.0.1", port)
    assert check.status == "FAIL" and str(port) in check.detail
    assert f"port {port} is taken" in check.fix and "--port" in check.fix
    assert doctor.check_port("127.0.0.1", port).status == "ok"  # free again
    assert doctor.check_port("127.0.0.1", 0).status == "ok"


def test_dht_port_is_checked_with_its_own_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check = doctor.check_port("127.0.0.1", port, "dht port", "--dht-port")
    assert check.status == "FAIL" and "--dht-port" in check.fix
    same = by_name(doctor.run_doctor(host="127.0.0.1", port=port, dht_port=port))["dht port"]
    assert same.status == "FAIL" and "different ports" in same.fix


def test_an_address_not_of_this_machine_fails():
    check = doctor.check_port("203.0.113.9", 0)  # TEST-NET-3: never a local address
    assert check.status == "FAIL" and "--host" in check.fix


def test_libzmq_without_curve_fails():
    fake = SimpleNamespace(zmq_version=lambda: "4.3.5", pyzmq_version=lambda: "26.0.0", has=lambda f: False)
    check = doctor.check_zmq(fake)
    assert check.status == "FAIL" and "CURVE" in check.detail and "pyzmq" in check.fix
    fake.has = lambda f: f == "curve"
    assert doctor.check_zmq(fake).status == "ok"
    assert doctor.check_zmq().status == "ok"  # this machine's


def test_missing_package_fails_with_the_install_fix():
    def version_of(name):
        if name == "pynacl":
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    checks = by_name(doctor.check_packages(version_of))
    assert checks["pynacl"].status == "FAIL" and "pip install" in checks["pynacl"].fix
    assert checks["hivemind"] == Check("hivemind", "ok", "1.0")


def test_p2pd_missing_or_not_executable(tmp_path):
    assert doctor.check_p2pd(tmp_path / "p2pd").status == "FAIL"
    (tmp_path / "p2pd").write_text("")
    (tmp_path / "p2pd").chmod(0o644)
    assert "chmod +x" in doctor.check_p2pd(tmp_path / "p2pd").fix
    assert doctor.check_p2pd().status == "ok"  # the one hivemind ships


def fake_torch(cuda_built, available, mps=False, kernels=True):
    props = SimpleNamespace(name="NVIDIA H100", total_memory=80 * 2**30)
    cuda = SimpleNamespace(is_available=lambda: available, get_device_properties=lambda i: props, device_count=lambda: 1)
    mps_backend = SimpleNamespace(is_available=lambda: mps)

    def ones(n, device):
        if not kernels:
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
        return SimpleNamespace(add_=lambda x: SimpleNamespace(item=lambda: 2.0))

    return SimpleNamespace(__version__="2.5.0", version=SimpleNamespace(cuda=cuda_built), cuda=cuda, ones=ones,
                           backends=SimpleNamespace(mps=mps_backend))


def test_torch_device_cases():
    gpu = by_name(doctor.check_torch(fake_torch("12.1", True), nvidia="535.1"))["device"]
    assert gpu.status == "ok" and "NVIDIA H100" in gpu.detail and "80.0 GiB" in gpu.detail
    no_kernels = by_name(doctor.check_torch(fake_torch("11.8", True, kernels=False), nvidia="535.1"))["device"]
    assert no_kernels.status == "FAIL" and "no kernel image" in no_kernels.detail and no_kernels.fix
    cpu = by_name(doctor.check_torch(fake_torch(None, False), nvidia=None))["device"]
    assert cpu.status == "warn" and "slow" in cpu.detail
    mismatch = by_name(doctor.check_torch(fake_torch(None, False), nvidia="535.1"))["device"]
    assert mismatch.status == "warn" and "NVIDIA driver" in mismatch.detail and "download.pytorch.org" in mismatch.fix
    old_driver = by_name(doctor.check_torch(fake_torch("12.4", False), nvidia="470.1"))["device"]
    assert old_driver.status == "warn" and "driver" in old_driver.fix
    assert by_name(doctor.check_torch(fake_torch(None, False, mps=True), nvidia=None))["device"].status == "warn"


def test_compile_cases():
    h100 = doctor.check_compile((9, 0), bf16=True, triton=True)
    assert h100.status == "ok" and "sm90" in h100.detail and "bf16" in h100.detail
    no_triton = doctor.check_compile((8, 0), bf16=True, triton=False)
    assert no_triton.status == "warn" and "uncompiled" in no_triton.detail and "pip install triton" in no_triton.fix
    pascal = doctor.check_compile((6, 0), bf16=False, triton=True)
    assert pascal.status == "warn" and "7.0" in pascal.detail and "fp32" in pascal.detail
    assert doctor.check_compile(compiler=None).status == "ok" and "needs a C++ compiler" in doctor.check_compile(compiler=None).detail
    assert "/usr/bin/c++" in doctor.check_compile(compiler="/usr/bin/c++").detail
    assert doctor._compile_check().name == "compile"  # this machine: no GPU


@pytest.mark.parametrize("reachable, status, words", [
    (True, "ok", "reachable at tcp://198.51.100.7:4000"),
    (False, "ok", "behind NAT"),  # information, not a failure
    (None, "warn", "unknown (2 checkers busy/unreachable): dialed back"),  # no verdict is not "behind NAT"
])
def test_reachability_outcomes(reachable, status, words):
    check = by_name(doctor.check_reachability(["/ip4/x"], 4000, 1.0, reach(reachable)))["reachability"]
    assert check.status == status and words in check.detail
    if reachable is None:
        assert "behind NAT" not in check.detail and "--reachability public" in check.fix


@pytest.mark.parametrize("skew, status", [(0.4, "ok"), (-0.4, "ok"), (5.0, "warn"), (-5.0, "warn"), (30.0, "FAIL")])
def test_clock_skew(skew, status):
    clock = by_name(doctor.check_reachability(["/ip4/x"], 4000, 1.0, reach(True, skew)))["clock"]
    assert clock.status == status
    assert ("timedatectl set-ntp true" in clock.fix) == (status != "ok")


def test_a_broken_or_hung_reachability_check_is_a_warning():
    def broken(join, port, *, timeout_s):
        raise RuntimeError("boom")

    checks = by_name(doctor.check_reachability(["/ip4/x"], 4000, 1.0, broken))
    assert checks["reachability"].status == "warn" and "boom" in checks["reachability"].detail
    assert checks["clock"].status == "skip"
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        doctor._bounded(lambda: time.sleep(30), 0.2)
    assert time.monotonic() - started < 2


def test_bad_join_address_fails_with_the_directory_error_text():
    checks = by_name(doctor.check_join(["/ip4/127.0.0.1/tcp/1"], None, 2.0))
    assert checks["dht bootstrap"].status == "FAIL" and "/p2p/" in checks["dht bootstrap"].detail


def test_unreachable_join_fails_fast_and_skips_reachability():
    fake = reach()
    started = time.monotonic()
    checks = by_name(doctor.run_doctor(join=[f"/ip4/127.0.0.1/tcp/{free_ports(1)[0]}/p2p/{SOME_PEER_ID}"],
                                       host="127.0.0.1", timeout_s=3.0, reachability=fake))
    assert time.monotonic() - started < 10
    assert checks["dht bootstrap"].status == "FAIL" and "gossiploco dht" in checks["dht bootstrap"].fix
    assert checks["reachability"].status == "skip" and fake.calls == []


def test_join_checks_the_real_bootstrap_and_its_swarm_key(bootstrap, tmp_path):
    from gossiploco.security.swarm_key import SwarmKey

    fake = reach(False)
    extra = f"/ip4/127.0.0.1/tcp/{free_ports(1)[0]}/p2p/{SOME_PEER_ID}"
    checks = by_name(doctor.run_doctor(join=[f"{bootstrap.address},{extra}"], host="127.0.0.1",
                                       swarm_key=str(bootstrap.swarm_key), timeout_s=10.0, reachability=fake))
    assert checks["dht bootstrap"].status == "warn"  # joined, but one address did not answer
    assert bootstrap.address in checks["dht bootstrap"].detail and extra in checks["dht bootstrap"].detail
    assert checks["swarm key"].status == "ok"
    assert checks["reachability"].status == "ok" and fake.calls[0][0] == [bootstrap.address, extra]
    wrong = SwarmKey.generate().save(tmp_path / "wrong.key")
    checks = by_name(doctor.check_join([bootstrap.address], str(wrong), 10.0))
    assert checks["dht bootstrap"].status == "ok"
    assert checks["swarm key"].status == "FAIL" and "gossiploco dht" in checks["swarm key"].fix


def test_text_output_and_exit_code():
    result = CliRunner().invoke(app, ["doctor", "--host", "127.0.0.1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "libzmq" in result.output and "ready to join" in result.output
    assert doctor.summary([Check("a", "ok", ""), Check("b", "FAIL", "")]).startswith("1 ok, 0 warn, 1 FAIL")


def doctor_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "gossiploco", "doctor", "--json", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a command-line run in a subprocess
def test_cli_json_without_join():
    proc = doctor_cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads(proc.stdout)
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in checks)
    names = {c["name"]: c["status"] for c in checks}
    assert {"python", "torch", "device", "hivemind", "pyzmq", "libzmq", "p2pd", "data port"} <= set(names)
    assert names["dht bootstrap"] == "skip" and "FAIL" not in names.values()


@pytest.mark.slow  # a command-line run in a subprocess
def test_cli_json_with_join(bootstrap):
    started = time.monotonic()
    proc = doctor_cli("--join", bootstrap.address, "--swarm-key", str(bootstrap.swarm_key), "--host", "127.0.0.1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["dht bootstrap"]["status"] == "ok" and checks["swarm key"]["status"] == "ok"
    assert checks["reachability"]["status"] in ("ok", "warn") and checks["clock"]["status"] in ("ok", "skip")
    assert time.monotonic() - started < 60


@pytest.mark.slow  # a command-line run in a subprocess
def test_cli_unreachable_join_exits_1_with_a_fix():
    started = time.monotonic()
    proc = doctor_cli("--join", f"/ip4/127.0.0.1/tcp/{free_ports(1)[0]}/p2p/{SOME_PEER_ID}", "--timeout", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bootstrap_check = {c["name"]: c for c in json.loads(proc.stdout)}["dht bootstrap"]
    assert bootstrap_check["status"] == "FAIL" and bootstrap_check["fix"]
    assert time.monotonic() - started < 30
