#!/usr/bin/env bash
# Every benchmark issue 42 asks for, in one GPU session of under ten minutes (one H100), each step under its own
# timeout and all of them under one deadline; the JSON (and each step's log) go to $OUT, else benchmarks/results/.
#
#   bash benchmarks/run_all.sh            # host, layer --kernel-time, model --profile: llama-1b 2048 (eager,
#                                         # compiled and CUDA graphs), llama-1b 8192, llama-8b-4l 8192
#   bash benchmarks/run_all.sh --quick    # the same cases, one timing round
#
# Durations on an H100 at the default two timing rounds (Triton tuning and Inductor compilation run cold in a fresh
# machine): host ~2 min (5 shapes x 19 cases x fwd and fwd+bwd, 2 rounds of 5 x 10 calls, and as many graph
# captures), layer ~1 min (4 shapes x 4 variants, 2 rounds of profiled calls), llama-1b 8192 and llama-8b-4l 8192
# ~1 min each, llama-1b 2048 ~3 min (four compiled cases, two of them CUDA-graphed). Three rounds take ~1.5x as long
# and overrun the ten minutes. The llama-1b 2048 run goes last and takes whatever time the others left.
set -u
cd "$(dirname "$0")/.."
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
DEADLINE=$((SECONDS + ${RUN_ALL_SECONDS:-570}))
ROUNDS=2
if [ "${1:-}" = "--quick" ]; then
    ROUNDS=1
fi
GPU=$(python -c "import torch; from benchmarks.common import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))" 2>/dev/null) || {
    echo "run_all.sh needs a CUDA GPU"
    exit 1
}
SUMMARY=()

# step NAME SECONDS COMMAND...: run COMMAND under min(SECONDS, time left to the deadline), its output also logged.
step() {
    local name=$1 limit=$2 left start rc
    shift 2
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 20 ]; then
        SUMMARY+=("$name: skipped, no time left")
        return
    fi
    echo "=== $name (timeout ${limit} s): $*"
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$DEST/log_$name.txt"
    rc=${PIPESTATUS[0]}
    SUMMARY+=("$name: exit $rc after $((SECONDS - start)) s")
}

step host 200 python -m benchmarks.host --rounds "$ROUNDS" --out "$DEST/host_$GPU.json"
step layer 90 python -m benchmarks.layer --kernel-time --impls parallel_lora --rounds "$ROUNDS" \
    --out "$DEST/layer_$GPU.json"
step model_llama-1b_8192 120 python -m benchmarks.model --preset llama-1b --tokens 8192 --rounds "$ROUNDS" \
    --profile --out "$DEST/model_${GPU}_llama-1b_8192.json"
step model_llama-8b-4l_8192 75 python -m benchmarks.model --preset llama-8b-4l --tokens 8192 \
    --rounds "$ROUNDS" --profile --out "$DEST/model_${GPU}_llama-8b-4l_8192.json"
step model_llama-1b_2048 600 python -m benchmarks.model --preset llama-1b --tokens 2048 \
    --compile-mode default,reduce-overhead --rounds "$ROUNDS" --profile --out "$DEST/model_${GPU}_llama-1b_2048.json"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
