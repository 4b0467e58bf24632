#!/bin/bash
# Wheels for a GPU machine that has PyTorch (Python 3.12) but no package registry: the project's
# dependencies its image lacks, into .wheels/ (git-ignored locally through .git/info/exclude).
# There: pip install --no-index --no-deps --target /tmp/site .wheels/*.whl; export PYTHONPATH=/tmp/site:$PWD
# (bench/results/gpu.md was measured so).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .wheels
binary=(hivemind==1.1.12 pyzmq==27.3.0 pynacl==1.6.2 cffi pycparser cryptography==48.0.0 starlette==1.10.0
        uvicorn==0.54.0 h11 base58 configargparse grpcio-tools==1.85.1 netaddr py-cid py-multihash py-multibase
        py-multicodec pydantic==2.13.4 pydantic_core==2.46.4 typing-inspection annotated-types morphys six
        blake3 mmh3 protobuf==7.36.2)  # numba and llvmlite: the image has them (llvmlite alone is 60 MB of the 64 MiB a call carries)
for p in "${binary[@]}"; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .wheels "$p"
done
"$PIP" wheel -q --no-deps -w .wheels varint==1.0.2 prefetch_generator==1.0.3 python-baseconv  # sdists only
ls .wheels
