#!/usr/bin/env bash
# Carry a newer Triton to the device machine, which has Triton 3.6 and installs nothing.
#
#   bash benchmarks/triton_carry.sh build 3.9.0       # here: writes .triton_carry/triton.tar.xz (~41 MB)
#   source benchmarks/triton_carry.sh use             # there (run with carry [".triton_carry"]): unpacks it to
#                                                     # /tmp/triton_carry and points PYTHONPATH and the tools at it
#
# The wheel is 286 MB, over the 64 MiB a run carries. What makes it fit: libtriton.so ships with its debug info
# (476 MB unpacked, 192 MB stripped); the AMD backend, CUPTI, proton and the instrumentation are not needed on an
# NVIDIA card; ptxas and nvdisasm are taken from the machine's own Triton (any ptxas that knows the card: Triton
# asks it for its version and writes PTX it accepts). The machine's Python is 3.12, hence the cp312 wheel.
# Add "/.triton_carry/" to .git/info/exclude: the tarball is carried, never committed.
case "${1:-}" in
build)
    set -euo pipefail
    version="${2:?which Triton version, e.g. 3.9.0}"
    work=$(mktemp -d)
    pip download -q "triton==${version}" --no-deps --python-version 3.12 --only-binary :all: \
        --platform manylinux_2_27_x86_64 -d "$work"
    (cd "$work" && unzip -q ./triton-*.whl 'triton/*' -x 'triton/backends/amd/*' \
        'triton/backends/nvidia/lib/cupti*' '*ptxas-blackwell' 'triton/_C/libproton.so' \
        'triton/instrumentation/*' 'triton/profiler/*')
    strip --strip-all "$work/triton/_C/libtriton.so"
    rm -f "$work/triton/backends/nvidia/bin/ptxas" "$work/triton/backends/nvidia/bin/nvdisasm"
    mkdir -p .triton_carry
    tar -C "$work" -cf - triton | xz -T2 -9 >.triton_carry/triton.tar.xz.tmp
    mv .triton_carry/triton.tar.xz.tmp .triton_carry/triton.tar.xz
    rm -rf "$work"
    ls -l .triton_carry/triton.tar.xz
    ;;
use)
    own=$(python -c "import os, triton; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin
    ptxas="$own/ptxas"
    [ -x "$ptxas-blackwell" ] && ptxas="$ptxas-blackwell"
    mkdir -p /tmp/triton_carry
    tar -xJf .triton_carry/triton.tar.xz -C /tmp/triton_carry
    # The machine's Triton registers an AMD backend by entry point; the carried tree has none: look in-tree only.
    export TRITON_BACKENDS_IN_TREE=1
    # Triton >= 3.9 calls every ptxas for sm_90 and up "ptxas-blackwell".
    export TRITON_PTXAS_PATH="$ptxas" TRITON_PTXAS_BLACKWELL_PATH="$ptxas"
    export TRITON_CUOBJDUMP_PATH="$own/cuobjdump" TRITON_NVDISASM_PATH="$own/nvdisasm"
    export TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=/tmp/triton_carry_cache
    export PYTHONPATH="/tmp/triton_carry:${PYTHONPATH:-}"
    python -c "import triton; print('carried Triton', triton.__version__, 'ptxas', '$ptxas')"
    ;;
*)
    echo "usage: bash $0 build VERSION | source $0 use" >&2
    exit 2
    ;;
esac
