#!/bin/sh
# `make gpu-check`: one command on a GPU machine (torch with CUDA installed,
# no network) that finishes in under 8 minutes on one H100/H200. Every step
# has its own time limit (their sum is 480 s) and its own log in $OUT
# (default build/gpu-check); steps.txt says how each ended. Steps:
#   build       the test build, installed in place (pip -e, no download)
#   cuda-tests  the tests marked cuda (pytest -m cuda)
#   check       python -m matepoint check: every claim on this GPU, each PASS,
#               FAIL or SKIP with its reason (check.json: every figure, the
#               GPU, driver, versions and date)
#   bench       the deep-latent case (bf16, 200 MiB latent) at LATENT_DEPTH
#               blocks: torch's checkpoint, torch's checkpoint inside
#               save_on_cpu (what transformers' offload=True runs), matepoint
#               and matepoint with its allocator: peak and step in one run
# $OUT holds at most 8 files (steps.txt, four logs, check.json, bench/):
# the C++ units compiled here are cached beside it, not in it.
# Exit status: 0 when every step passed.
set -u
OUT=${OUT:-build/gpu-check}
PY=${PYTHON:-python3}
LATENT_DEPTH=${LATENT_DEPTH:-48}
mkdir -p "$OUT"
: > "$OUT/steps.txt"
# the C++ units install_allocator() compiles, built once for every step
export MATEPOINT_CACHE_DIR="${MATEPOINT_CACHE_DIR:-$OUT-cache}"
failed=""

step() {
    name=$1
    seconds=$2
    shift 2
    started=$(date +%s)
    timeout -k 10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
    status=$?
    took=$(( $(date +%s) - started ))
    if [ "$status" -eq 0 ]; then
        verdict=PASS
    elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        verdict="FAIL (timed out after ${seconds}s)"
    else
        verdict="FAIL (exit $status)"
    fi
    echo "$name: $verdict in ${took}s (log: $OUT/$name.log)" | tee -a "$OUT/steps.txt"
    [ "$status" -eq 0 ] || failed="$failed $name"
    return "$status"
}

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu-check: $PY has no torch with a usable CUDA GPU: nothing run" | tee -a "$OUT/steps.txt"
    exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))" \
    | tee -a "$OUT/steps.txt"
step build 100 "$PY" -m pip install -q --no-build-isolation --no-deps -e . || {
    echo "gpu-check: the build failed; nothing else run" | tee -a "$OUT/steps.txt"
    exit 1
}
step cuda-tests 110 "$PY" -m pytest -q -rA -p no:cacheprovider -m cuda tests
step check 170 "$PY" -m matepoint check --json "$OUT/check.json"
step bench 100 "$PY" -m matepoint.bench --gpu-check --cases latent \
    --latent-depth "$LATENT_DEPTH" --modes torch,torch+save_on_cpu,matepoint,matepoint+alloc --out "$OUT/bench"
tail -n 30 "$OUT/check.log" 2>/dev/null
tail -n 40 "$OUT/bench.log" 2>/dev/null
if [ -n "$failed" ]; then
    echo "gpu-check: failed:$failed" | tee -a "$OUT/steps.txt"
    exit 1
fi
echo "gpu-check: every step passed" | tee -a "$OUT/steps.txt"
