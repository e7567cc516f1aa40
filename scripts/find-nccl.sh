#!/bin/sh
# find-nccl.sh - find NCCL >= 2.28 (headers with the device API, and libnccl.so.2) for
# the build, looking in this order: $NCCL_HOME, the CUDA toolkit, the system paths,
# an installed Python nvidia-nccl-cu13 / -cu12 package. Prints a make fragment
# (NCCL_INC, NCCL_LIB, NCCL_VERSION) on success; on failure names every place it
# looked, on stderr, and exits 1.
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}
python=${PYTHON:-python3}
looked=""
MIN=22800

try() { # try INCLUDE_DIR LIB_DIR...
    inc=$1
    shift
    if [ ! -f "$inc/nccl.h" ]; then
        looked="$looked
  $inc: no nccl.h"
        return 1
    fi
    code=$(sed -n 's/^#define NCCL_VERSION_CODE *\([0-9][0-9]*\).*/\1/p' "$inc/nccl.h")
    if [ -z "$code" ] || [ "$code" -lt $MIN ]; then
        looked="$looked
  $inc: NCCL version code ${code:-unknown}, need >= $MIN (2.28)"
        return 1
    fi
    if [ ! -f "$inc/nccl_device.h" ]; then
        looked="$looked
  $inc: nccl.h $code but no nccl_device.h (the device API)"
        return 1
    fi
    for lib in "$@"; do
        if [ -e "$lib/libnccl.so.2" ]; then
            echo "NCCL_INC := $inc"
            echo "NCCL_LIB := $lib"
            echo "NCCL_VERSION := $code"
            exit 0
        fi
    done
    looked="$looked
  $inc: headers $code, but no libnccl.so.2 in: $*"
    return 1
}

if [ -n "$NCCL_HOME" ]; then
    try "$NCCL_HOME/include" "$NCCL_HOME/lib" "$NCCL_HOME/lib64"
else
    looked="$looked
  \$NCCL_HOME: not set"
fi
try "$cuda_home/include" "$cuda_home/lib" "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib"
try /usr/include /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib
try /usr/local/include /usr/local/lib /usr/local/lib64
for pkg in nvidia.nccl; do
    dir=$("$python" -c "import $pkg as m; print(list(m.__path__)[0])" 2>/dev/null)
    if [ -n "$dir" ]; then
        try "$dir/include" "$dir/lib"
    else
        looked="$looked
  $python: no nvidia-nccl-cu13 or -cu12 package (import nvidia.nccl failed)"
    fi
done

echo "comet needs NCCL >= 2.28 with its device API (nccl_device.h) and did not find it. Looked at:$looked
Set NCCL_HOME to an NCCL 2.28+ install, or: $python -m pip install nvidia-nccl-cu13" >&2
exit 1
