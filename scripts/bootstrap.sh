#!/usr/bin/env bash
# Set up .venv with gossiploco and its test tools. Idempotent.
#
# torch: a venv that can already import torch (for instance a GPU user's CUDA build, visible
# through --system-site-packages) keeps it. Otherwise the pinned torch==2.13.0 is installed
# first, so that the unpinned requirement of gossiploco does not pull a newer build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The Python that will run gossiploco: the existing .venv's, or the one that creates it
if [ -x .venv/bin/python ]; then RUNNER=.venv/bin/python; else RUNNER=$PYTHON; fi
if ! "$RUNNER" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    echo "bootstrap.sh: gossiploco needs Python 3.11 or newer (the version it is tested with); $RUNNER is" \
         "$("$RUNNER" --version 2>&1 || echo 'not runnable'). Run with PYTHON=python3.11 ./scripts/bootstrap.sh" \
         "(remove .venv first if it was made with an older Python)." >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
.venv/bin/python -c "import torch, gossiploco; print(f'gossiploco {gossiploco.__version__} ready (torch {torch.__version__}, CUDA {torch.cuda.is_available()})')"
