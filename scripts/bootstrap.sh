#!/usr/bin/env bash
# Set up .venv with gossiploco and its test tools. Idempotent.
#
# torch: a venv that can already import torch (for instance a GPU user's CUDA build, visible
# through --system-site-packages) keeps it. Otherwise the pinned torch==2.13.0 is installed
# first, so that the unpinned requirement of gossiploco does not pull a newer build.
#
# System tools for the tests that need more than Python: the network-namespace tests
# (tests/test_netem.py, test_nat_testbed.py, test_nat.py: `ip` and `tc` from iproute2, `sysctl` from
# procps, `nft` from nftables; they also need root) and the dashboard's browser test (Debian's
# `chromium`). As root with apt-get, the missing ones are installed (Debian package names); not root,
# or without apt-get, one line says which tests will skip and how to install what they need.
# GOSSIPLOCO_SYSTEM_PACKAGES=0 leaves the system alone (the tests that need these tools then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
APT_TIMEOUT_S=${APT_TIMEOUT_S:-900}

missing_system_packages() {  # the Debian packages whose commands are not on PATH
    local missing=()
    { command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
    command -v sysctl >/dev/null 2>&1 || missing+=(procps)
    command -v nft >/dev/null 2>&1 || missing+=(nftables)
    [ -x /usr/bin/chromium ] || missing+=(chromium)  # the path tests/test_dashboard.py launches
    echo "${missing[@]}"
}

install_system_packages() {
    [ "${GOSSIPLOCO_SYSTEM_PACKAGES:-1}" = 0 ] && return 0
    local missing
    missing=$(missing_system_packages)
    [ -z "$missing" ] && [ "$(id -u)" -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        local browser=""
        [ -x /usr/bin/chromium ] || browser=", and the browser test (no /usr/bin/chromium)"
        local how="sudo .venv/bin/python -m pytest -q"
        [ -n "$missing" ] && how="sudo ./scripts/bootstrap.sh (it installs $missing), then $how"
        echo "bootstrap.sh: not root: pytest will skip the network-namespace tests (test_netem, test_nat_testbed," \
             "test_nat: they need root${missing:+ and ${missing// /, }})$browser; to run every test: $how" >&2
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap.sh: no apt-get here, so the tests that need ${missing// /, } will skip; install them with your" \
             "package manager (ip, tc, sysctl, nft, and Chromium at /usr/bin/chromium)" >&2
        return 0
    fi
    echo "bootstrap.sh: installing $missing (apt-get) for the network-namespace and browser tests" >&2
    local log
    log=$(mktemp)
    if ! { timeout "$APT_TIMEOUT_S" apt-get update -qq \
           && DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT_S" apt-get install -y -qq --no-install-recommends \
              $missing; } >"$log" 2>&1; then
        echo "bootstrap.sh: installing $missing failed (the tests that need it will skip); apt-get said:" >&2
        tail -n 5 "$log" >&2
    elif [ -n "$(missing_system_packages)" ]; then
        echo "bootstrap.sh: still missing after apt-get: $(missing_system_packages) (the tests that need it will skip)" >&2
    fi
    rm -f "$log"
}
# The Python that will run gossiploco: the existing .venv's, or the one that creates it
if [ -x .venv/bin/python ]; then RUNNER=.venv/bin/python; else RUNNER=$PYTHON; fi
if ! "$RUNNER" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    echo "bootstrap.sh: gossiploco needs Python 3.11 or newer (the version it is tested with); $RUNNER is" \
         "$("$RUNNER" --version 2>&1 || echo 'not runnable'). Run with PYTHON=python3.11 ./scripts/bootstrap.sh" \
         "(remove .venv first if it was made with an older Python)." >&2
    exit 1
fi
install_system_packages
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# The package's bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set no process writes it, and every peer,
# companion and DHT process a swarm starts would compile every module it imports again (about 1 s of CPU each).
.venv/bin/python -m compileall -q gossiploco testbed bench > /dev/null
# The compressed codecs' kernels (numba) compile once per machine and are cached beside their module: compiled
# here, every process that later runs a codec (a peer, a test) loads them instead of compiling them at once.
.venv/bin/python -c "from gossiploco.mixing.compression import build_codec
for name in ('4bit', 'topk'):
    build_codec(name).prepare()"
.venv/bin/python -c "import torch, gossiploco; print(f'gossiploco {gossiploco.__version__} ready (torch {torch.__version__}, CUDA {torch.cuda.is_available()})')"
