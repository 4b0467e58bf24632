#!/bin/bash
# The device checks of a session lent a GPU, as one prepared call of the device tool (its command runs in the
# repository root; carry .wheels, made here first by scripts/gpu_wheels.sh):
#
#   bash scripts/gpu_check.sh            # reports into $OUT (the device tool's folder), else /tmp/gpu-check
#
# Each part runs under its own timeout and writes its report as it goes, so a part stopped at its limit still
# leaves what it measured; a failed part does not stop the others. The parts, cheapest first:
#   1. the GPU tests of the suite (skipped on a CPU machine): the companion's vectors page-locked and drained;
#   2. a mix's host round trip, in process, through the companion's registered vectors, and as the companion did
#      before (bench/gpu.py, "A mix's host round trip");
#   3. four peers, diloco and globalm1-localm2, with the companion off, then on (bench/gpu.py, part 3).
# PART_S (default 170) bounds each peer part; DEVICE (default cuda) and PYTHON (default python) let a CPU machine run
# the plumbing: DEVICE=cpu PYTHON=.venv/bin/python PART_S=120 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
work=$(mktemp -d /tmp/gpu-check.XXXX)  # the logs, bundled into $out at the end (the device tool returns 8 files at most)
device=${DEVICE:-cuda}
part_s=${PART_S:-170}
py=${PYTHON:-python}
mkdir -p "$out"
bundle() {  # the reports as files of their own, the logs in one archive
  cp "$work"/*.md "$work/parts.txt" "$out"/ 2>/dev/null
  tar czf "$out/gpu-check-logs.tgz" -C "$work" .
}
trap bundle EXIT
if compgen -G ".wheels/*.whl" > /dev/null; then
  pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl > "$work/pip.log" 2>&1 || echo "pip failed: $work/pip.log"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
(nvidia-smi || true) > "$work/nvidia-smi.txt" 2>&1
failed=0
part() {  # part NAME SECONDS COMMAND...: run it, log it, note its exit status
  local name=$1 seconds=$2
  shift 2
  local began=$SECONDS
  timeout "$seconds" "$@" > "$work/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - began)) s: $*" | tee -a "$work/parts.txt"
  [ "$code" -eq 0 ] || failed=1
}
part tests 90 "$py" -m pytest -q -p no:cacheprovider tests/test_companion.py -k "page_locked or pack_asks"
part host-vectors 90 "$py" bench/gpu.py --device "$device" --sizes none --no-end-of-round --presets '' \
  --out "$work/host-vectors.md"
for companion in off on; do
  part "peers-companion-$companion" "$part_s" "$py" bench/gpu.py --device "$device" --sizes none --no-end-of-round \
    --no-host-vectors --presets diloco,globalm1-localm2 --rounds 3 --inner-steps 50 --companion "$companion" \
    --out "$work/peers-companion-$companion.md"
done
exit $failed
