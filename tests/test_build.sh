#!/usr/bin/env bash
# test_build.sh - the build's choices, on any machine (no GPU, no PyTorch needed): which
# NCCL scripts/find-nccl.sh picks, with a fake CUDA toolkit, a fake nvidia-nccl package and
# a stub `torch` module on PYTHONPATH standing in for the real ones (an explicit NCCL_HOME
# wins, or fails naming itself; PyTorch's NCCL release is matched; the rest in the
# documented order); how make finds it, and what `make` builds by default; that ptxas
# serializes no FP8 GEMM row's wgmma but the known ones; and that the sources' comments
# carry no dates. One line per check, "PASS name" or "FAIL name: why"
# (or "SKIP name: why"), then "N passed, N failed, N skipped"; exit 1 when any failed.
# Usage: tests/test_build.sh   (from anywhere; it runs in the repository's root)
set -u
cd "$(dirname "$0")/.." || exit 1
. tests/check.sh

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset NCCL_HOME PYTHON PYTHONPATH
# Under `make test` the make below must not take that make's flags and variables.
unset MAKEFLAGS MFLAGS MAKELEVEL

# fake_nccl DIR CODE: an NCCL install at DIR whose nccl.h says version CODE (find-nccl.sh
# reads the headers' version and checks the library is there; it links nothing).
fake_nccl() {
    mkdir -p "$1/include" "$1/lib"
    printf '#define NCCL_VERSION_CODE %s\n' "$2" >"$1/include/nccl.h"
    : >"$1/include/nccl_device.h"
    : >"$1/lib/libnccl.so.2"
}
# stub_torch DIR RELEASE: a `torch` package at DIR whose torch.cuda.nccl.version() returns
# RELEASE ("2.28.7"), or raises as a CPU-only PyTorch does ("none").
stub_torch() {
    mkdir -p "$1/torch/cuda"
    echo "from . import cuda" >"$1/torch/__init__.py"
    echo "from . import nccl" >"$1/torch/cuda/__init__.py"
    if [ "$2" == none ]; then
        printf 'def version():\n    raise AttributeError("no NCCL in this build")\n' >"$1/torch/cuda/nccl.py"
    else
        printf 'def version():\n    return (%s)\n' "${2//./, }" >"$1/torch/cuda/nccl.py"
    fi
}

# find NAME ENV...: scripts/find-nccl.sh with ENV (VAR=VALUE words) and the fake CUDA
# toolkit; sets rc, out (the make fragment) and err.
find_nccl() {
    local name=$1
    shift
    env "$@" CUDA_HOME="$tmp/cuda" timeout 60 scripts/find-nccl.sh >"$tmp/out" 2>"$tmp/err"
    rc=$?
    out=$(cat "$tmp/out")
    err=$(cat "$tmp/err")
}
# picks NAME INCLUDE_DIR ENV...: find-nccl.sh succeeds with INCLUDE_DIR's NCCL.
picks() {
    local name=$1 inc=$2
    shift 2
    find_nccl "$name" "$@"
    if [ "$rc" -eq 0 ] && [[ $out == *"NCCL_INC := $inc"$'\n'* ]]; then pass "$name"
    else fail "$name" "exit code $rc, expected 0 with NCCL_INC := $inc (stdout: $out; stderr: $err)"; fi
}

fake_nccl "$tmp/cuda" 22809
fake_nccl "$tmp/py/nvidia/nccl" 22807
fake_nccl "$tmp/old" 22703
mkdir -p "$tmp/empty"

# ---------------------------------------------------------------------------------------
# An explicit NCCL_HOME: that NCCL, or an error naming NCCL_HOME and the path, never a
# silent fallback to another NCCL.

find_nccl nccl-home-missing NCCL_HOME="$tmp/none"
if [ "$rc" -ne 0 ] && [ -z "$out" ] && [[ $err == *"NCCL_HOME=$tmp/none: no such directory"* ]]; then
    pass nccl-home-missing
else fail nccl-home-missing "exit code $rc, expected an error naming NCCL_HOME=$tmp/none (stdout: $out; stderr: $err)"; fi
find_nccl nccl-home-no-nccl NCCL_HOME="$tmp/empty"
if [ "$rc" -ne 0 ] && [ -z "$out" ] && [[ $err == *"NCCL_HOME=$tmp/empty: no NCCL"*"$tmp/empty/include: no nccl.h"* ]]; then
    pass nccl-home-no-nccl
else fail nccl-home-no-nccl "exit code $rc, expected an error naming NCCL_HOME=$tmp/empty (stdout: $out; stderr: $err)"; fi
find_nccl nccl-home-too-old NCCL_HOME="$tmp/old"
if [ "$rc" -ne 0 ] && [[ $err == *"NCCL_HOME=$tmp/old"*"need >= 22800"* ]]; then pass nccl-home-too-old
else fail nccl-home-too-old "exit code $rc, expected an error naming NCCL_HOME and the version (stderr: $err)"; fi
picks nccl-home-used "$tmp/py/nvidia/nccl/include" NCCL_HOME="$tmp/py/nvidia/nccl"
if [[ $out == *"NCCL_FOUND_WITH := $tmp/py/nvidia/nccl"* ]]; then pass nccl-home-recorded
else fail nccl-home-recorded "the fragment does not record the NCCL_HOME it was found with: $out"; fi

# ---------------------------------------------------------------------------------------
# PyTorch's NCCL: where torch is importable, the NCCL of the release it loads (its package
# first), so comet_moe runs beside it; an explicit NCCL_HOME still wins.

if ! command -v python3 >/dev/null 2>&1; then
    for n in torch-package torch-release-elsewhere torch-no-match torch-too-old torch-without-nccl no-torch \
        nccl-home-over-torch; do skip "$n" "python3 is not installed"; done
else
    stub_torch "$tmp/t2287" 2.28.7
    stub_torch "$tmp/t2289" 2.28.9
    stub_torch "$tmp/t2285" 2.28.5
    stub_torch "$tmp/t2215" 2.21.5
    stub_torch "$tmp/tcpu" none
    picks torch-package "$tmp/py/nvidia/nccl/include" PYTHONPATH="$tmp/t2287:$tmp/py"
    if [ -z "$err" ]; then pass torch-package-quiet; else fail torch-package-quiet "stderr: $err"; fi
    # Its package is another release: the CUDA toolkit's is PyTorch's.
    picks torch-release-elsewhere "$tmp/cuda/include" PYTHONPATH="$tmp/t2289:$tmp/py"
    # No NCCL of PyTorch's release: said on stderr, and the usual search.
    picks torch-no-match "$tmp/cuda/include" PYTHONPATH="$tmp/t2285:$tmp/py"
    if [[ $err == *"PyTorch"*"loads NCCL 2.28.5"*"nvidia-nccl-cu13==2.28.5"* ]]; then pass torch-no-match-warns
    else fail torch-no-match-warns "stderr does not say PyTorch's release and how to get it: $err"; fi
    picks torch-too-old "$tmp/cuda/include" PYTHONPATH="$tmp/t2215:$tmp/py"
    if [[ $err == *"loads NCCL 2.21.5, older than the 2.28"* ]]; then pass torch-too-old-warns
    else fail torch-too-old-warns "stderr: $err"; fi
    picks torch-without-nccl "$tmp/cuda/include" PYTHONPATH="$tmp/tcpu:$tmp/py"
    if [ -z "$err" ]; then pass torch-without-nccl-quiet; else fail torch-without-nccl-quiet "stderr: $err"; fi
    # Without PyTorch: the toolkit's NCCL before the package's, as before.
    picks no-torch "$tmp/cuda/include" PYTHONPATH="$tmp/py"
    picks nccl-home-over-torch "$tmp/cuda/include" PYTHONPATH="$tmp/t2287:$tmp/py" NCCL_HOME="$tmp/cuda"
fi

# ---------------------------------------------------------------------------------------
# make: the default target builds build/handle_memory too (README cites it); NCCL_HOME
# pointing at nothing stops make, naming it; another NCCL_HOME looks again by itself; make
# clean needs no NCCL. Dry runs (-n) into a build directory of their own; make still finds NCCL for real then.

if ! command -v make >/dev/null 2>&1; then
    for n in make-default-target make-nccl-home-missing make-nccl-home-looks-again make-clean-needs-no-nccl; do
        skip "$n" "make is not installed"
    done
else
    make -n BUILD="$tmp/b" >"$tmp/make.out" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ]; then skip make-default-target "make -n failed here (no NCCL found?): $(tail -n 3 "$tmp/make.out")"
    elif grep -q -- "-o $tmp/b/handle_memory " "$tmp/make.out"; then pass make-default-target
    else fail make-default-target "make (all) would not build $tmp/b/handle_memory"; fi
    make -n BUILD="$tmp/b" NCCL_HOME="$tmp/none" >"$tmp/make.out" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ] && grep -q "NCCL_HOME=$tmp/none: no such directory" "$tmp/make.out"; then pass make-nccl-home-missing
    else fail make-nccl-home-missing "exit code $rc: $(tail -n 3 "$tmp/make.out")"; fi
    make -n BUILD="$tmp/b" NCCL_HOME="$tmp/cuda" >"$tmp/make.out" 2>&1
    if grep -q "NCCL_INC := $tmp/cuda/include" "$tmp/b/nccl.mk" 2>/dev/null; then pass make-nccl-home-looks-again
    else fail make-nccl-home-looks-again "$tmp/b/nccl.mk: $(cat "$tmp/b/nccl.mk" 2>&1)"; fi
    make clean BUILD="$tmp/b" NCCL_HOME="$tmp/none" >"$tmp/make.out" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ] && [ ! -e "$tmp/b" ]; then pass make-clean-needs-no-nccl
    else fail make-clean-needs-no-nccl "exit code $rc: $(tail -n 3 "$tmp/make.out")"; fi
fi

# ---------------------------------------------------------------------------------------
# ptxas's notes on the FP8 GEMM, compiled as make compiles it: a row whose wgmma ptxas
# serializes (C75xx: a wait it had to insert) runs its mainloop a tensor-core round trip at
# a time, a third of its speed or worse, and nothing else says so. The 128-wide E4M3 rows
# with groups along M are serialized (their two-deep pipeline; they run slower than
# 256-wide, which the layer uses: docs/ARCHITECTURE.md); every other row must be free of it.

serialized_allowed=" fp8_nt_128 fp8_nt_128_direct fp8_nt_128_splits fp8_nt_128_push fp8_nt_128_dispatch "
if ! command -v "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" >/dev/null 2>&1 && ! command -v nvcc >/dev/null 2>&1; then
    skip fp8-gemm-wgmma-not-serialized "no nvcc here"
else
    make -n -B BUILD="$tmp/k" "$tmp/k/src/gemm/gemm_fp8.o" >"$tmp/make.out" 2>&1
    cmd=$(grep -E -- '-c src/gemm/gemm_fp8\.cu' "$tmp/make.out" | tail -n 1)
    if [ -z "$cmd" ]; then
        skip fp8-gemm-wgmma-not-serialized "make -n gave no compile line here: $(tail -n 2 "$tmp/make.out")"
    else
        mkdir -p "$tmp/k/src/gemm"
        if ! eval "$cmd" >"$tmp/ptxas.out" 2>&1; then
            fail fp8-gemm-wgmma-not-serialized "the compile failed: $(tail -n 3 "$tmp/ptxas.out")"
        else
            mapfile -t rows < <(grep -o 'X([a-z0-9_]*' src/gemm/variants.h | sed 's/^X(//')
            bad=""
            while read -r code v; do  # a note: its code and the row's index in variants.h
                name=${rows[$v]:-"row $v"}
                [[ $serialized_allowed == *" $name "* ]] || bad="$bad $name ($code)"
            done < <(grep -oE "C75[0-9]+\).*grouped_gemm_kernelILi[0-9]+E" "$tmp/ptxas.out" |
                     sed -E 's/^(C75[0-9]+)\).*ILi([0-9]+)E$/\1 \2/' | sort -u)
            if [ -z "$bad" ]; then pass fp8-gemm-wgmma-not-serialized
            else fail fp8-gemm-wgmma-not-serialized "ptxas serializes the wgmma of:$bad (ptxas's notes C7514, C7518, ...)"; fi
        fi
    fi
fi

# ---------------------------------------------------------------------------------------
# The sources' comments say how a figure was measured, not when: no dates in the C, CUDA
# and shell files (dates belong with the measurements, in docs/).

dated=$(grep -rnE '20[0-9][0-9]-[01][0-9]' src tests tools harness scripts include bench Makefile --include='*.c' \
    --include='*.h' --include='*.cu' --include='*.cuh' --include='*.sh' --include=Makefile)
if [ -z "$dated" ]; then pass sources-carry-no-dates
else fail sources-carry-no-dates "dates in: $(cut -c1-200 <<<"$dated" | tr '\n' ' ')"; fi

finish
