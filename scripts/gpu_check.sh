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
#   3. four peers, diloco and globalm1-localm2, with the companion off, then on (bench/gpu.py, part 3); the first
#      pays for the empty compile cache of a fresh machine (about 60 s more), so it gets FIRST_PART_S;
#   4. the 4-peer all-reduce on the host's cores with torch's default threads, what a peer runs, plaintext and
#      encrypted beside gloo (bench/allreduce.py --threads 0; bench/results/chunk-math.md).
# TOTAL_S (default 560, under the device tool's 600 s a command) bounds the whole: a part gets what is left of it,
# and the reports are bundled into $OUT (8 files at most come back) before it runs out. PART_S (default 170) and
# FIRST_PART_S (default 220) bound the peer parts; DEVICE (default cuda) and PYTHON (default python) let a CPU
# machine run the plumbing: DEVICE=cpu PYTHON=.venv/bin/python PART_S=60 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
work=$(mktemp -d /tmp/gpu-check.XXXX)  # the logs, bundled into $out at the end (the device tool returns 8 files at most)
device=${DEVICE:-cuda}
part_s=${PART_S:-170}
first_part_s=${FIRST_PART_S:-220}
total_s=${TOTAL_S:-560}
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
part() {  # part NAME SECONDS COMMAND...: run it under the smaller of SECONDS and what TOTAL_S leaves, log it
  local name=$1 seconds=$2
  shift 2
  local left=$((total_s - SECONDS - 5))
  [ "$seconds" -le "$left" ] || seconds=$left
  if [ "$seconds" -lt 20 ]; then
    echo "$name: skipped, $left s left of TOTAL_S=$total_s: $*" | tee -a "$work/parts.txt"
    failed=1
    return
  fi
  local began=$SECONDS
  timeout "$seconds" "$@" > "$work/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - began)) s (limit $seconds s): $*" | tee -a "$work/parts.txt"
  [ "$code" -eq 0 ] || failed=1
}
part tests 90 "$py" -m pytest -q -p no:cacheprovider tests/test_companion.py -k "page_locked or pack_asks"
part host-vectors 90 "$py" bench/gpu.py --device "$device" --sizes none --no-end-of-round --presets '' \
  --out "$work/host-vectors.md"
limit=$first_part_s
for companion in off on; do
  part "peers-companion-$companion" "$limit" "$py" bench/gpu.py --device "$device" --sizes none --no-end-of-round \
    --no-host-vectors --presets diloco,globalm1-localm2 --rounds 3 --inner-steps 50 --companion "$companion" \
    --out "$work/peers-companion-$companion.md"
  limit=$part_s
done
part allreduce-default-threads 150 "$py" bench/allreduce.py --backends zmq-inplace,gloo --curve --threads 0 --reps 5 \
  --overlap none --out "$work/allreduce-default-threads.md"
exit $failed
