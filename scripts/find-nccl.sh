#!/bin/sh
# find-nccl.sh - find NCCL >= 2.28 (headers with the device API, and libnccl.so.2) for
# the build. comet compiles NCCL's device API into its kernels, so it must run with the
# NCCL release whose headers it was built with. The search, in order:
#   1. $NCCL_HOME, when set: that NCCL, or the build stops and names NCCL_HOME and the
#      path (never another NCCL in its place).
#   2. Where PyTorch is installed ($PYTHON, default python3, imports torch) and loads an
#      NCCL (torch.cuda.nccl.version(), which needs no GPU): an NCCL of exactly that
#      release, first the nvidia-nccl-cu13 / -cu12 package PyTorch loads it from
#      (nvidia.nccl, headers included), then the places of 3. So the comet_moe package
#      runs beside that PyTorch without a second build, and the tool runs with it too.
#      None of that release: a warning, and the search goes on as if PyTorch were absent
#      (the tool works; comet_moe refuses to run beside that PyTorch and says why).
#   3. The CUDA toolkit, the system paths, an installed nvidia-nccl-cu13 / -cu12 package:
#      the first NCCL >= 2.28 found.
# Prints a make fragment (NCCL_INC, NCCL_LIB, NCCL_VERSION, and NCCL_FOUND_WITH: the
# NCCL_HOME it was found with) on success; on failure names every place it looked, on
# stderr, and exits 1.
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}
python=${PYTHON:-python3}
looked=""
want="" # the version code a candidate must have (PyTorch's NCCL), or any >= MIN
MIN=22800

found() { # found INCLUDE_DIR LIB_DIR CODE: print the make fragment and stop
    echo "NCCL_INC := $1"
    echo "NCCL_LIB := $2"
    echo "NCCL_VERSION := $3"
    echo "NCCL_FOUND_WITH := $NCCL_HOME"
    exit 0
}

release() { # release CODE: 22809 -> 2.28.9
    echo "$(($1 / 10000)).$(($1 / 100 % 100)).$(($1 % 100))"
}

try() { # try INCLUDE_DIR LIB_DIR...: found, or a line in $looked and return 1
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
    if [ -n "$want" ] && [ "$code" != "$want" ]; then
        looked="$looked
  $inc: NCCL $(release "$code"), not PyTorch's $(release "$want")"
        return 1
    fi
    if [ ! -f "$inc/nccl_device.h" ]; then
        looked="$looked
  $inc: nccl.h $code but no nccl_device.h (the device API)"
        return 1
    fi
    for lib in "$@"; do
        [ -e "$lib/libnccl.so.2" ] && found "$inc" "$lib" "$code"
    done
    looked="$looked
  $inc: headers $code, but no libnccl.so.2 in: $*"
    return 1
}

try_package() { # the nvidia-nccl-cu13 / -cu12 package's NCCL, where it is installed
    dir=$("$python" -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
    if [ -n "$dir" ]; then
        try "$dir/include" "$dir/lib"
    else
        looked="$looked
  $python: no nvidia-nccl-cu13 or -cu12 package (import nvidia.nccl failed)"
    fi
}

try_installed() { # the CUDA toolkit, then the system paths
    try "$cuda_home/include" "$cuda_home/lib" "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib"
    try /usr/include /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib
    try /usr/local/include /usr/local/lib /usr/local/lib64
}

# 1. An explicit NCCL_HOME is the only place looked at.
if [ -n "$NCCL_HOME" ]; then
    if [ ! -d "$NCCL_HOME" ]; then
        echo "NCCL_HOME=$NCCL_HOME: no such directory. Set NCCL_HOME to an NCCL 2.28+ install" \
            "(include/nccl.h, include/nccl_device.h, lib/libnccl.so.2), or leave it unset to search." >&2
        exit 1
    fi
    try "$NCCL_HOME/include" "$NCCL_HOME/lib" "$NCCL_HOME/lib64"
    echo "NCCL_HOME=$NCCL_HOME: no NCCL >= 2.28 with its device API there:$looked
Set NCCL_HOME to an NCCL 2.28+ install (include/nccl.h, include/nccl_device.h, lib/libnccl.so.2), or leave it unset to search." >&2
    exit 1
fi

# 2. The NCCL release PyTorch loads, where PyTorch is installed.
torch_nccl=$("$python" -c "
import torch
v = torch.cuda.nccl.version()
print(v[0] * 10000 + v[1] * 100 + v[2])" 2>/dev/null | tail -n 1)
case $torch_nccl in
'' | *[!0-9]*) ;;
*)
    if [ "$torch_nccl" -lt $MIN ]; then
        echo "find-nccl.sh: warning: PyTorch ($python) loads NCCL $(release "$torch_nccl"), older than the 2.28" \
            "comet needs: the comet_moe package will not run beside this PyTorch (the tool is not affected)." >&2
    else
        want=$torch_nccl
        try_package
        try_installed
        echo "find-nccl.sh: warning: PyTorch ($python) loads NCCL $(release "$want"), and no NCCL of that release" \
            "with its headers was found. Looked at:$looked
Building against another NCCL: the comet tool works, but the comet_moe package will refuse to run beside this" \
            "PyTorch. For PyTorch's: $python -m pip install nvidia-nccl-cu13==$(release "$want") (or -cu12: it" \
            "carries the headers), then make clean; make. Or set NCCL_HOME." >&2
        want=""
        looked=""
    fi
    ;;
esac

# 3. The first NCCL >= 2.28 installed.
looked="$looked
  \$NCCL_HOME: not set"
try_installed
try_package

echo "comet needs NCCL >= 2.28 with its device API (nccl_device.h) and did not find it. Looked at:$looked
Set NCCL_HOME to an NCCL 2.28+ install, or: $python -m pip install nvidia-nccl-cu13" >&2
exit 1
